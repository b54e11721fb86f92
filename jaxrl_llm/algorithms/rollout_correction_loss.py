"""Bypass mode of rollout correction: the policy loss "bypass_mode" and the REINFORCE loss it can use.

In bypass mode the trainer skips the old-log-prob pass and passes the sampler's log-probs as
`old_log_prob`. The loss then computes, inside each micro-batch and from the current log-probs (weights
and mask carry no gradient), the rollout-correction weights and rejection mask of
`compute_rollout_correction_and_rejection_mask`, and dispatches on `rollout_correction.loss_type`:

* "ppo_clip": veRL's vanilla PPO loss with the ratio π_θ / π_rollout, on the rejection mask. The IS
  weights are computed for the metrics only: the PPO ratio already is the importance ratio, so
  multiplying by them would count it twice.
* "reinforce": -sg(w)·A·log π_θ, aggregated on the rejection mask (`compute_policy_loss_reinforce`).

Micro-batching is exact for the loss (every weight and rejection decision is per token or per row, and
a row is never split) and for the metrics except the standard deviations and the effective sample
size (see `rollout_correction`). Batch normalisation of the weights is refused: its batch mean is not
known inside a micro-batch.
"""

from __future__ import annotations

import jax

from jaxrl_llm.algorithms.aggregation import LossNorm, agg_loss, token_metric_mean
from jaxrl_llm.algorithms.policy_loss import (
    PolicyLossConfig,
    apply_is_weights,
    as_f32,
    compute_policy_loss_vanilla,
    register_policy_loss,
)
from jaxrl_llm.algorithms.rollout_correction import compute_rollout_correction_and_rejection_mask


def compute_policy_loss_reinforce(rollout_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                                  response_mask: jax.Array, *, config: PolicyLossConfig,
                                  norm: LossNorm | None = None, rollout_is_weights: jax.Array | None = None,
                                  token_select: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """REINFORCE with optional IS correction: per token -A·log π_θ, times sg(w) when weights are given.

    No ratio and no clipping: the gradient is -sg(w)·A·∇log π_θ, the IS-corrected policy gradient.

    Args:
      rollout_log_prob: [B, T] the sampler's log-probs (for the ppo_kl metric only).
      log_prob: [B, T] the current policy's (differentiated).
      advantages: [B, T].
      response_mask: [B, T] 0/1, rejection already applied.
      config: loss_agg_mode.
      norm: the mini-batch's denominators when this is one micro-batch.
      rollout_is_weights: [B, T] or None.
      token_select: unused (the shared signature).
    Returns:
      pg_loss scalar, and metrics: ppo_kl (token mean of rollout_log_prob - log_prob).
    """
    del token_select
    rollout_log_prob, log_prob, adv = as_f32(rollout_log_prob, log_prob, advantages)
    pg_losses = apply_is_weights(-adv * log_prob, rollout_is_weights)  # [B, T]
    pg_loss = agg_loss(pg_losses, response_mask, config.loss_agg_mode, norm=norm)
    kl = jax.lax.stop_gradient(rollout_log_prob - log_prob)
    return pg_loss, {"ppo_kl": token_metric_mean(kl, response_mask, norm)}


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                                    response_mask: jax.Array, *, config: PolicyLossConfig,
                                    norm: LossNorm | None = None, rollout_is_weights: jax.Array | None = None,
                                    token_select: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """veRL's bypass-mode loss: rollout correction per micro-batch, then PPO-clip or REINFORCE.

    Args:
      old_log_prob: [B, T] the sampler's log-probs (bypass mode passes them as the old ones).
      log_prob: [B, T] the current policy's (differentiated).
      advantages: [B, T].
      response_mask: [B, T] 0/1, before rejection.
      config: the loss hyperparameters; `config.rollout_correction` (a `RolloutCorrectionConfig`) holds
        loss_type and the IS / rejection settings.
      norm: the mini-batch's denominators when this is one micro-batch; with None the loss divides by
        this batch's counts after rejection, the metrics by its counts before (veRL's local behaviour).
      rollout_is_weights: ignored (veRL too): the weights are computed here.
      token_select: passed to the PPO loss (unused by it).
    Returns:
      pg_loss scalar, and metrics: those of the chosen loss (pg_clipfrac, pg_clipfrac_lower, ppo_kl; or
      ppo_kl) and the "rollout_corr/..." metrics of `compute_rollout_correction_and_rejection_mask`
      on the current log-probs.
    """
    del rollout_is_weights
    rc = config.rollout_correction
    if rc is None:
        raise ValueError("actor.policy_loss.rollout_correction: loss_mode 'bypass_mode' needs the "
                         "algorithm.rollout_correction config")
    rollout_log_prob = old_log_prob
    weights, mask, rc_metrics = compute_rollout_correction_and_rejection_mask(
        jax.lax.stop_gradient(log_prob), rollout_log_prob, response_mask, rc, norm=norm)
    if rc.loss_type == "reinforce":
        pg_loss, metrics = compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, mask, config=config,
                                                         norm=norm, rollout_is_weights=weights)
    else:  # "ppo_clip"; loss_type was validated by the call above
        pg_loss, metrics = compute_policy_loss_vanilla(rollout_log_prob, log_prob, advantages, mask, config=config,
                                                       norm=norm, rollout_is_weights=None, token_select=token_select)
    return pg_loss, {**metrics, **rc_metrics}

