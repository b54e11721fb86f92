"""The algorithm pieces a run's config selects: the actor's policy loss, rollout correction, and the
jitted advantage function with the batch fields it reads."""

from __future__ import annotations

import jax

from jaxrl_llm.algorithms import (
    AdvantageConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    apply_kl_penalty,
    compute_rollout_correction_and_rejection_mask,
)
from jaxrl_llm.trainer.batch import TrainBatch
from jaxrl_llm.trainer.config import RunConfig, rollout_correction_enabled


def policy_loss_config(run: RunConfig, rc: RolloutCorrectionConfig | None) -> PolicyLossConfig:
    """The actor's policy loss from `actor.*` and `actor.policy_loss.*`; bypass mode swaps in veRL's
    `bypass_mode` loss, which reads the rollout-correction settings."""
    a, p = run.actor, run.policy_loss
    return PolicyLossConfig(
        loss_mode="bypass_mode" if rc is not None and rc.bypass_mode else p.loss_mode,
        clip_ratio_low=a.low, clip_ratio_high=a.high, clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode,
        clip_cov_ratio=p.clip_cov_ratio, clip_cov_lb=p.clip_cov_lb, clip_cov_ub=p.clip_cov_ub,
        kl_cov_ratio=p.kl_cov_ratio, ppo_kl_coef=p.ppo_kl_coef, dro_beta=p.dro_beta, tau_pos=a.tau_pos,
        tau_neg=a.tau_neg, rollout_correction=rc)


def rollout_correction_config(run: RunConfig) -> RolloutCorrectionConfig | None:
    """`algorithm.rollout_correction.*`, or None when it is off."""
    return run.rollout_correction if rollout_correction_enabled(run.rollout_correction) else None


def exactly_on_policy(run: RunConfig, est, rc: RolloutCorrectionConfig | None) -> str | None:
    """Why the old-log-prob pass can be skipped, or None where it cannot (veRL's shortcut).

    A step of one mini-batch (`actor.ppo_mini_batch_size` = `data.train_batch_size`) and one epoch updates
    from the very params that sampled nothing else since the last sync: the old policy is the current one, so
    the update uses its own log-probs, detached, as the old ones (the ratio is 1 by construction). Nothing
    else may read the old log-probs separately: not the KL penalty in the reward, nor rollout correction (its
    weights compare them with the sampler's), nor an estimator that takes them (or Σπ² of their pass), nor
    training on stale samples (async modes)."""
    a = run.actor
    if a.ppo_epochs != 1 or a.ppo_mini_batch_size != run.data.train_batch_size:
        return None
    if run.algo.use_kl_in_reward or rc is not None or run.async_training.off_policy:
        return None
    if {"old_log_probs", "sum_pi_squared", "rollout_is_weights"} & set(est.inputs):
        return None
    return (f"one mini-batch (actor.ppo_mini_batch_size = data.train_batch_size = {a.ppo_mini_batch_size}) and "
            "one epoch: the update uses its own log-probs, detached, as the old ones")


def make_adv_fn(run: RunConfig, est, rc: RolloutCorrectionConfig | None):
    """One jitted function from the scored batch to what the update needs: rollout correction
    (decoupled mode: importance weights and rejection of the whole batch, from the old and the
    sampler's log-probs), token-level rewards (with the in-reward KL penalty when configured), then
    the configured advantage estimator, called with the batch fields it declares."""
    algo = run.algo
    config = AdvantageConfig(gamma=algo.gamma, lam=algo.lam, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
                             gdpo_reward_keys=algo.gdpo_reward_keys, gdpo_reward_weights=algo.gdpo_reward_weights)

    def fn(scores, mask, f, kl_coef):
        metrics, out = {}, {}
        if rc is not None and not rc.bypass_mode:
            weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
                f["old_log_prob"], f["rollout_log_probs"], mask, rc)
            out["loss_mask"] = mask
            if weights is not None:
                out["rollout_is_weights"] = weights
        rewards = scores
        if algo.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(scores, f["old_log_prob"], f["ref_log_prob"], mask, kl_coef,
                                                   algo.kl_penalty)
            metrics = {**metrics, **kl_metrics}
        inputs = {**f, **out, "old_log_probs": f.get("old_log_prob")}
        adv, ret = est.fn(rewards, mask, config=config, **{k: inputs.get(k) for k in est.inputs})
        return {**out, "token_level_rewards": rewards, "advantages": adv, "returns": ret}, metrics

    return jax.jit(fn)

def adv_inputs(run: RunConfig, est, rc: RolloutCorrectionConfig | None, batch: TrainBatch) -> dict:
    """The batch fields the advantage function reads, by the estimator's input names."""
    f, need = batch.fields, set(est.inputs)
    out = {"index": batch.group_ids}
    # Only the [R, Tr] fields `adv_fn` reads go to the device: the rollout correction's and the in-reward
    # KL's log-probs, and the estimator's own inputs.
    decoupled_rc, kl_in_reward = rc is not None and not rc.bypass_mode, run.algo.use_kl_in_reward
    wanted = {"values", "sum_pi_squared", "reward_baselines"} & need
    if "old_log_probs" in need or kl_in_reward or decoupled_rc:
        wanted.add("old_log_prob")
    if kl_in_reward:
        wanted.add("ref_log_prob")
    if decoupled_rc:
        wanted.add("rollout_log_probs")
    for name in sorted(wanted):
        if name in f:
            out[name] = f[name]
    if "reward_components" in need:
        keys = run.algo.gdpo_reward_keys or ()
        out["reward_components"] = {k: f[f"score/{k}"] for k in keys}
    missing = sorted(k for k in need - {"old_log_probs", "rollout_is_weights"} if k not in out)
    if "old_log_probs" in need and "old_log_prob" not in out:
        missing.append("old_log_prob")
    if missing:
        raise ValueError(f"algorithm.adv_estimator={run.algo.adv_estimator!r} needs the batch fields "
                         f"{missing}, which this step did not produce")
    return out
