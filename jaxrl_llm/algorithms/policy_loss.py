"""Policy losses by veRL's names: the shared config and signature, the registry, and PPO ("vanilla").

Every policy loss registered here has one signature (`PolicyLossFn`):

    fn(old_log_prob, log_prob, advantages, response_mask, *, config, norm=None,
       rollout_is_weights=None, token_select=None) -> (pg_loss scalar, metrics dict of scalars)

All arrays are [B, T]; only `log_prob` is differentiated. `config` (a `PolicyLossConfig`) is static.
`norm` is the mini-batch's `LossNorm` when the call sees one micro-batch (see `aggregation`): the loss
and every metric are then additive over the micro-batches of the mini-batch. `rollout_is_weights`
are rollout-correction weights, multiplied into each loss the way veRL does for that loss.
`token_select` is read only by clip_cov and kl_cov (see `policy_loss_cov`). Metric keys are veRL's
without the "actor/" prefix, which the trainer adds.

The other losses live in `policy_loss_variants` (gspo, sapo, gpg, geo_mean, cispo, dppo_tv,
dppo_kl, dro) and `policy_loss_cov` (clip_cov, kl_cov); importing `jaxrl_llm.algorithms` registers
them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.algorithms.aggregation import LossNorm, agg_loss, token_metric_mean

# veRL clamps the log-ratio before exp in most losses, so a stale token cannot overflow the ratio.
LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Static hyperparameters of a policy loss (hashable: part of the compiled program).

    veRL spreads these over `actor.*` (clip ratios, `loss_agg_mode`, `tau_*`) and
    `actor.policy_loss.*` (the rest); the trainer gathers them here. `clip_ratio_low/high` are already
    resolved (veRL's `clip_ratio` fallback is the trainer's job).

    Attributes:
      loss_mode: the registry name of the loss.
      clip_ratio_low, clip_ratio_high: the PPO clip range [1 - low, 1 + high]; dppo_*: the divergence
        thresholds for negative / positive advantages; geo_mean: the clip range of the log-ratio.
      clip_ratio_c: vanilla: the dual-clip bound (> 1); dppo_*: the cap of the truncated ratio.
      loss_agg_mode: see `aggregation.agg_loss` (sapo and geo_mean ignore it).
      clip_cov_ratio, clip_cov_lb, clip_cov_ub: clip_cov's share of tokens and covariance window.
      kl_cov_ratio, ppo_kl_coef: kl_cov's share of tokens and the weight of their |log-ratio| penalty.
      dro_beta: dro's quadratic log-ratio penalty (required, > 0, for dro).
      tau_pos, tau_neg: sapo's gate temperatures for positive / non-positive advantages.
      rollout_correction: bypass_mode only: a frozen rollout-correction config.
    """

    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    rollout_correction: Any = None


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


# ---- helpers shared by the losses ----------------------------------------------------------------------


def as_f32(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """The losses compute in float32 whatever the input dtype (bf16 log-probs lose the small ratios)."""
    return tuple(jnp.asarray(x).astype(jnp.float32) for x in arrays)


def apply_is_weights(pg_losses: jax.Array, rollout_is_weights: jax.Array | None) -> jax.Array:
    """Multiply the [B, T] per-token loss by the (constant) rollout-correction weights, if any."""
    if rollout_is_weights is None:
        return pg_losses
    return pg_losses * jax.lax.stop_gradient(jnp.asarray(rollout_is_weights, jnp.float32))


def clamped_log_ratio(old_log_prob: jax.Array, log_prob: jax.Array) -> jax.Array:
    """log(pi / pi_old) clamped to +-20, as veRL does before exp in vanilla, sapo, cispo and dppo_*."""
    return jnp.clip(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clipped_surrogates(advantages: jax.Array, ratio: jax.Array, config: PolicyLossConfig) -> tuple[jax.Array, ...]:
    """PPO's two per-token terms -A·r and -A·clip(r, 1 - low, 1 + high), each [B, T]."""
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    return pg_losses1, pg_losses2


# ---- vanilla -------------------------------------------------------------------------------------------


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                                response_mask: jax.Array, *, config: PolicyLossConfig,
                                norm: LossNorm | None = None, rollout_is_weights: jax.Array | None = None,
                                token_select: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clip with separate low/high ranges (DAPO clip-higher) and dual clip for A < 0.

    Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)):
      loss = max(-A·r, -A·clip(r, 1 - low, 1 + high)), and for A < 0 also capped at -A·c
    (dual clip, https://arxiv.org/abs/1912.09729), so a very unlikely old action with a negative
    advantage cannot push the loss without bound. Rollout-correction weights multiply the per-token
    loss.

    Args:
      old_log_prob: [B, T] log-probs under the rollout (old) policy.
      log_prob: [B, T] log-probs under the current policy (differentiated).
      advantages: [B, T].
      response_mask: [B, T] 0/1.
      config: clip_ratio_low/high, clip_ratio_c (the dual-clip bound, > 1), loss_agg_mode.
      norm: the mini-batch's denominators when this is one micro-batch (see `aggregation`).
      rollout_is_weights: [B, T] or None.
      token_select: unused (the shared signature).
    Returns:
      pg_loss scalar, and metrics: pg_clipfrac (fraction of tokens where the clipped term won),
      pg_clipfrac_lower (fraction where the dual clip bound won, A < 0), ppo_kl (mean of
      old_log_prob - log_prob, the k1 estimate of KL(old || new)).
    """
    del token_select
    if not config.clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {config.clip_ratio_c}")
    old_log_prob, log_prob, adv = as_f32(old_log_prob, log_prob, advantages)
    neg_kl = clamped_log_ratio(old_log_prob, log_prob)  # [B, T]
    ratio = jnp.exp(neg_kl)

    pg_losses1, pg_losses2 = clipped_surrogates(adv, ratio, config)
    clip_pg_losses1 = jnp.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * config.clip_ratio_c
    clip_pg_losses2 = jnp.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = jnp.where(adv < 0, clip_pg_losses2, clip_pg_losses1)  # [B, T]
    pg_losses = apply_is_weights(pg_losses, rollout_is_weights)

    pg_loss = agg_loss(pg_losses, response_mask, config.loss_agg_mode, norm=norm)
    clipped_lower = (clip_pg_losses1 > pg_losses3) & (adv < 0)
    metrics = {
        "pg_clipfrac": token_metric_mean((pg_losses2 > pg_losses1).astype(jnp.float32), response_mask, norm),
        "pg_clipfrac_lower": token_metric_mean(clipped_lower.astype(jnp.float32), response_mask, norm),
        "ppo_kl": token_metric_mean(jax.lax.stop_gradient(-neg_kl), response_mask, norm),
    }
    return pg_loss, metrics
