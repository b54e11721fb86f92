"""PPO clipped value (critic) loss, veRL's `compute_value_loss`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.algorithms.aggregation import LossNorm, agg_loss, token_metric_mean


def compute_value_loss(vpreds: jax.Array, returns: jax.Array, values: jax.Array, response_mask: jax.Array,
                       cliprange_value: float, loss_agg_mode: str = "token-mean",
                       norm: LossNorm | None = None) -> tuple[jax.Array, jax.Array]:
    """0.5 · agg(max((v - R)², (clip(v, V_old ± c) - R)²)).

    Clipping the new prediction to within `cliprange_value` of the rollout-time value keeps the
    critic from moving far in one update; taking the max makes the clip pessimistic.

    Args:
      vpreds: [B, T] values from the critic being trained (differentiated).
      returns: [B, T] targets (e.g. GAE returns).
      values: [B, T] values at rollout time.
      response_mask: [B, T] 0/1.
      cliprange_value: clip half-width.
      loss_agg_mode: see `agg_loss` (static); norm: micro-batch denominators (see `aggregation`).
    Returns:
      vf_loss scalar, vf_clipfrac scalar (fraction of tokens where the clipped term won).
    """
    vpreds = vpreds.astype(jnp.float32)
    returns = returns.astype(jnp.float32)
    values = values.astype(jnp.float32)
    vpred_clipped = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = jnp.square(vpreds - returns)
    vf_losses2 = jnp.square(vpred_clipped - returns)
    vf_loss = 0.5 * agg_loss(jnp.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, norm=norm)
    vf_clipfrac = token_metric_mean((vf_losses2 > vf_losses1).astype(jnp.float32), response_mask, norm)
    return vf_loss, jax.lax.stop_gradient(vf_clipfrac)
