"""Outcome estimators that compare each response with the others of its prompt group: grpo (and its
veRL alias grpo_vectorized), rloo (alias rloo_vectorized), reinforce_plus_plus_baseline, opo, gpg,
grpo_passk and gdpo.

Each response's score is the sum of its `token_level_rewards` over T (the reward sits on its last
token), so a row with an all-zero mask still has a score and still counts in its group, as in veRL;
its advantages are 0 because every estimator here multiplies by the mask. Groups are reduced with
segment sums over `index` (no Python loop over the batch), so any mix of group sizes works.

Calling convention and shapes: see `advantages_base`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.algorithms.advantages_base import (
    DEFAULT_CONFIG,
    AdvantageConfig,
    AdvantageEstimator,
    group_max,
    group_stats,
    group_sum,
    outcome_scores,
    register_adv_est,
)
from jaxrl_llm.algorithms.masked import masked_whiten


def _broadcast(per_response: jax.Array, response_mask: jax.Array) -> jax.Array:
    """[B] -> [B, T]: the response's advantage on each of its tokens, 0 elsewhere."""
    return per_response[:, None] * response_mask.astype(jnp.float32)


def _grpo_scalar(scores: jax.Array, index: jax.Array, config: AdvantageConfig) -> jax.Array:
    """[B] GRPO advantage per response; a group of one uses mean 0 and std 1 (veRL)."""
    count, centred, std = group_stats(scores, index)
    single = count == 1
    centred = jnp.where(single, scores, centred)
    if not config.norm_adv_by_std_in_grpo:
        return centred
    return centred / (jnp.where(single, 1.0, std) + config.epsilon)


@register_adv_est(AdvantageEstimator.GRPO, inputs=("index",))
@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED, inputs=("index",))
def compute_grpo_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array, *, index: jax.Array,
                                   config: AdvantageConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
    """GRPO: each response's score relative to its group, (score - mean) / (std + epsilon).

    std is unbiased (torch.std). A group of one uses mean 0 and std 1, i.e. keeps its raw score
    (veRL, both the loop and the vectorised version). With `config.norm_adv_by_std_in_grpo=False`
    (Dr.GRPO) the std division is dropped; both registry names read it (veRL's trainer passes it to
    grpo only, so its grpo_vectorized always divides). A group of equal scores gives exactly 0.

    Args:
      token_level_rewards: [B, T] float; the score of a response is its sum over T.
      response_mask: [B, T] 0/1.
      index: [B] int dense group ids in [0, B).
      config: reads `epsilon`, `norm_adv_by_std_in_grpo`.
    Returns:
      (advantages, returns), both [B, T] = the per-response advantage broadcast over the mask.
    """
    adv = _broadcast(_grpo_scalar(outcome_scores(token_level_rewards), index, config), response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.RLOO, inputs=("index",))
@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED, inputs=("index",))
def compute_rloo_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array, *, index: jax.Array,
                                   config: AdvantageConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
    """RLOO: score minus the mean of the other responses of its group, n/(n-1)·(r - group mean).

    A group of one keeps its raw score (veRL's `rloo`; veRL's `rloo_vectorized` gives it 0 instead,
    and here both names run this function). `config` is unused.

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1; index: [B] dense group ids.
    Returns:
      (advantages, returns), both [B, T].
    """
    del config
    scores = outcome_scores(token_level_rewards)  # [B]
    count, centred, _ = group_stats(scores, index)
    adv = jnp.where(count > 1, centred * count / jnp.maximum(count - 1, 1), scores)  # [B]
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE, inputs=("index",))
def compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards: jax.Array, response_mask: jax.Array, *, index: jax.Array,
        config: AdvantageConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++ with a group baseline: subtract the group mean, then whiten over the batch's mask.

    A group of one uses mean 0. The whitening weighs each response by its number of tokens (it runs
    over the [B, T] tiles). `config` is unused.

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1; index: [B] dense group ids.
    Returns:
      (advantages, returns), both [B, T], whitened over the mask and masked.
    """
    del config
    scores = outcome_scores(token_level_rewards)  # [B]
    count, centred, _ = group_stats(scores, index)
    mask = response_mask.astype(jnp.float32)
    adv = _broadcast(jnp.where(count == 1, scores, centred), mask)  # [B, T]
    adv = masked_whiten(adv, mask) * mask
    return adv, adv


@register_adv_est(AdvantageEstimator.OPO, inputs=("index",))
def compute_opo_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array, *, index: jax.Array,
                                  config: AdvantageConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
    """OPO (arXiv:2505.23585): score minus the group's length-weighted mean score, Σ l·r / Σ l.

    l is a response's number of mask tokens. A group of one has baseline 0 (keeps its raw score).
    A group of two or more whose rows are all empty has Σ l = 0: veRL divides 0 by 0 and its
    advantages are NaN on every token (NaN · 0 stays NaN); here the baseline is 0 and, every row
    being masked, the advantages are 0. `config` is unused.

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1; index: [B] dense group ids.
    Returns:
      (advantages, returns), both [B, T] = the per-response advantage broadcast over the mask.
    """
    del config
    scores = outcome_scores(token_level_rewards)  # [B]
    lengths = jnp.sum(response_mask.astype(jnp.float32), axis=-1)  # [B]
    count = group_sum(jnp.ones_like(scores), index)
    # Shifting by the group max cancels in r - baseline and makes equal scores give exactly 0.
    shifted = scores - group_max(scores, index)
    total_length = group_sum(lengths, index)
    baseline = group_sum(lengths * shifted, index) / jnp.maximum(total_length, 1.0)
    adv = jnp.where(count == 1, scores, jnp.where(total_length > 0, shifted - baseline, 0.0))
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.GPG, inputs=("index",))
def compute_gpg_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array, *, index: jax.Array,
                                  config: AdvantageConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
    """GPG (arXiv:2504.02546): alpha · (score - group mean) / f_norm, with no std division.

    alpha = B / max(#responses whose score is non-zero, 1) over the whole batch (empty rows count),
    which scales the gradient up when most responses score 0. f_norm is veRL's keyword default 1
    (veRL's trainer never sets it). A group of one uses mean 0 (keeps alpha · its score).
    `config` is unused.

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1; index: [B] dense group ids.
    Returns:
      (advantages, returns), both [B, T] = the per-response advantage broadcast over the mask.
    """
    del config
    f_norm = 1.0
    scores = outcome_scores(token_level_rewards)  # [B]
    alpha = scores.shape[0] / jnp.maximum(jnp.count_nonzero(scores), 1)
    count, centred, _ = group_stats(scores, index)
    adv = alpha * jnp.where(count == 1, scores, centred) / f_norm
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.GRPO_PASSK, inputs=("index",))
def compute_grpo_passk_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array, *,
                                         index: jax.Array, config: AdvantageConfig = DEFAULT_CONFIG
                                         ) -> tuple[jax.Array, jax.Array]:
    """Pass@k (arXiv:2503.19595): only each group's best response gets an advantage, best - second best.

    Divided by (group std + epsilon) when `config.norm_adv_by_std_in_grpo`. When the best score is
    shared, best - second best is 0, so which of the tied responses veRL's topk picks does not
    matter: every advantage of the group is 0.

    Groups of one: veRL raises ValueError. So do we when `index` is concrete (not traced); under
    `jit` we cannot, and a group of one gets advantage 0.

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1; index: [B] dense group ids.
      config: reads `epsilon`, `norm_adv_by_std_in_grpo`.
    Returns:
      (advantages, returns), both [B, T] = the per-response advantage broadcast over the mask.
    """
    if not isinstance(index, jax.core.Tracer):
        sizes = np.bincount(np.asarray(index).reshape(-1))
        if np.any(sizes == 1):
            raise ValueError(f"grpo_passk needs at least 2 responses per group; group ids "
                             f"{np.flatnonzero(sizes == 1).tolist()} have 1")
    scores = outcome_scores(token_level_rewards)  # [B]
    count, _, std = group_stats(scores, index)
    best = group_max(scores, index)  # [B]
    is_best = scores == best
    num_best = group_sum(is_best.astype(jnp.float32), index)
    runner_up = group_max(jnp.where(is_best, -jnp.inf, scores), index)  # -inf when every score ties
    gets_adv = is_best & (num_best == 1) & (count > 1)
    adv = best - jnp.where(gets_adv, runner_up, best)  # finite everywhere; 0 where not `gets_adv`
    if config.norm_adv_by_std_in_grpo:
        adv = adv / (std + config.epsilon)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.GDPO, inputs=("index", "reward_components"))
def compute_gdpo_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array, *, index: jax.Array,
                                   reward_components: dict[str, jax.Array],
                                   config: AdvantageConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
    """GDPO (arXiv:2601.05242): GRPO-normalise each reward component in its group, sum them with
    weights, then whiten the sum over the batch's mask.

    A_k = grpo(r_k) per component k (group of one: its raw r_k, as GRPO), A = Σ_k w_k A_k, and the
    advantages are masked_whiten(A · mask, mask) · mask. As in veRL's trainer, the components come
    from the reward function's per-key scores and `token_level_rewards` is not read (so an in-reward
    KL penalty does not reach gdpo's advantages).

    Args:
      token_level_rewards: [B, T] float (unused; kept for the convention).
      response_mask: [B, T] 0/1; index: [B] dense group ids.
      reward_components: name -> [B] float, at least every key of `config.gdpo_reward_keys`.
      config: reads `gdpo_reward_keys` (required), `gdpo_reward_weights` (None: all 1; else one per
        key), `epsilon`, `norm_adv_by_std_in_grpo` (veRL's trainer does not pass the latter to gdpo,
        which therefore always divides by the std there; the default True gives veRL's numbers).
    Returns:
      (advantages, returns), both [B, T], whitened over the mask and masked.
    """
    del token_level_rewards
    keys = config.gdpo_reward_keys
    if not keys:
        raise ValueError("gdpo needs algorithm.gdpo_reward_keys: the names of the reward components that "
                         "the reward function returns (e.g. ('format_reward', 'accuracy_reward'))")
    missing = [k for k in keys if k not in reward_components]
    if missing:
        raise ValueError(f"gdpo reward components {missing} are missing; given: {sorted(reward_components)}")
    weights = config.gdpo_reward_weights or (1.0,) * len(keys)
    if len(weights) != len(keys):
        raise ValueError(f"gdpo_reward_weights has {len(weights)} entries for {len(keys)} gdpo_reward_keys")
    total = sum(w * _grpo_scalar(jnp.asarray(reward_components[k], jnp.float32), index, config)
                for k, w in zip(keys, weights))  # [B]
    mask = response_mask.astype(jnp.float32)
    adv = masked_whiten(_broadcast(total, mask), mask) * mask
    return adv, adv
