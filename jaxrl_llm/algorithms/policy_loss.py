"""PPO clipped policy loss (veRL's "vanilla") and a registry of policy losses by name.

A policy loss maps `(old_log_prob, log_prob, advantages, response_mask)` [B, T] plus keyword
hyperparameters to `(pg_loss scalar, metrics dict of scalars)`. Metric keys are veRL's without the
"actor/" prefix, which the trainer adds.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.algorithms.aggregation import LossNorm, agg_loss, token_metric_mean

# veRL clamps the log-ratio before exp so a stale token cannot overflow the ratio.
_LOG_RATIO_CLAMP = 20.0


def compute_policy_loss_vanilla(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                                response_mask: jax.Array, *, clip_ratio_low: float = 0.2,
                                clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                                loss_agg_mode: str = "token-mean",
                                norm: LossNorm | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clip with separate low/high ranges (DAPO clip-higher) and dual clip for A < 0.

    Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)):
      loss = max(-A·r, -A·clip(r, 1 - low, 1 + high)), and for A < 0 also capped at -A·c
    (dual clip, https://arxiv.org/abs/1912.09729), so a very unlikely old action with a negative
    advantage cannot push the loss without bound.

    Args:
      old_log_prob: [B, T] log-probs under the rollout (old) policy.
      log_prob: [B, T] log-probs under the current policy (differentiated).
      advantages: [B, T].
      response_mask: [B, T] 0/1.
      clip_ratio_low, clip_ratio_high: PPO clip range [1 - low, 1 + high].
      clip_ratio_c: dual-clip bound; must be a Python number > 1.
      loss_agg_mode: see `agg_loss` (static).
      norm: the mini-batch's denominators when this is one micro-batch (see `aggregation`); the
        metrics then become additive over micro-batches too.
    Returns:
      pg_loss scalar, and metrics: pg_clipfrac (fraction of tokens where the clipped term won),
      pg_clipfrac_lower (fraction where the dual clip bound won, A < 0), ppo_kl (mean of
      old_log_prob - log_prob, the k1 estimate of KL(old || new)).
    """
    if isinstance(clip_ratio_c, int | float) and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")
    neg_kl = jnp.clip(log_prob.astype(jnp.float32) - old_log_prob.astype(jnp.float32),
                      -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = jnp.exp(neg_kl)
    adv = advantages.astype(jnp.float32)

    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * jnp.clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = jnp.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * clip_ratio_c
    clip_pg_losses2 = jnp.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = jnp.where(adv < 0, clip_pg_losses2, clip_pg_losses1)  # [B, T]

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, norm=norm)
    clipped_lower = (clip_pg_losses1 > pg_losses3) & (adv < 0)
    metrics = {
        "pg_clipfrac": token_metric_mean((pg_losses2 > pg_losses1).astype(jnp.float32), response_mask, norm),
        "pg_clipfrac_lower": token_metric_mean(clipped_lower.astype(jnp.float32), response_mask, norm),
        "ppo_kl": token_metric_mean(jax.lax.stop_gradient(-neg_kl), response_mask, norm),
    }
    return pg_loss, metrics


# ---- registry ----------------------------------------------------------------------------------------

PolicyLossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` (veRL's `actor.policy_loss.loss_mode`)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if POLICY_LOSS_REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"policy loss {name!r} is already registered to "
                             f"{POLICY_LOSS_REGISTRY[name].__qualname__}")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under `name`."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; known: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


register_policy_loss("vanilla")(compute_policy_loss_vanilla)
