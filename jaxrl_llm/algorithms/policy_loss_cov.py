"""Clip-Cov and KL-Cov (https://arxiv.org/abs/2505.22617): PPO that acts on high-covariance tokens.

Both rank the response tokens by the covariance term (A - mean A)·(log_prob - mean log_prob) over
the batch and treat a small share of them specially: clip_cov drops the gradient of a random few
inside a covariance window, kl_cov adds an |log-ratio| penalty to the top few. The choice depends on
the whole batch (its means, its token count), so under micro-batching the trainer calls
`select_cov_tokens` once on the mini-batch (with log-probs from a forward pass of the current
policy) and passes the result as `token_select` to every micro-batch; each loss then equals its
share of the mini-batch's loss exactly. Without `token_select` a loss selects on its own inputs,
which is veRL's behaviour on one batch.

The count of selected tokens is veRL's k = max(1, int(ratio · number of response tokens)), with
the product in float64 as in Python: float32 would give int(0.0002 · 10000) = 1 instead of 2. The
selection is computed with ranks and masks, so every shape stays static under `jit`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.algorithms.aggregation import LossNorm, agg_loss, token_metric_mean
from jaxrl_llm.algorithms.policy_loss import (
    PolicyLossConfig,
    apply_is_weights,
    as_f32,
    clipped_surrogates,
    register_policy_loss,
)

Metrics = dict[str, jax.Array]


def _count_thresholds(ratio: float, n_max: int) -> np.ndarray:
    """n_j = the least n with int(ratio · n) >= j (float64 product), for j = 1 .. int(ratio · n_max).

    int(ratio · n) is non-decreasing in n, so it equals the number of n_j <= n. The table is
    computed on the host at trace time; it has ratio · n_max entries (a few hundred for veRL's
    default ratio of 2e-4 and a million tokens).
    """
    j = np.arange(1, int(ratio * n_max) + 1, dtype=np.int64)
    n = np.ceil(j / ratio).astype(np.int64)  # within a few of the answer
    count = lambda m: (ratio * m.astype(np.float64)).astype(np.int64)
    for _ in range(64):
        lower = np.where(count(n - 1) >= j, n - 1, n)
        fixed = np.where(count(lower) < j, lower + 1, lower)
        if np.array_equal(fixed, n):
            break
        n = fixed
    assert np.all(count(n) >= j) and np.all(count(n - 1) < j), "threshold search did not converge"
    return n


def _selection_count(ratio: float, num_tokens: jax.Array, n_max: int) -> jax.Array:
    """veRL's max(1, int(ratio · num_tokens)) for a traced token count <= n_max, as an int32 scalar."""
    thresholds = jnp.asarray(_count_thresholds(ratio, n_max), jnp.int32)  # [K]
    return jnp.maximum(jnp.sum(thresholds <= num_tokens.astype(jnp.int32)), 1).astype(jnp.int32)


def _lowest_k(score: jax.Array, k: jax.Array) -> jax.Array:
    """Bool mask of the k entries of `score` [B, T] with the lowest values (ties: the earlier index)."""
    flat = score.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rank = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return (rank < k).reshape(score.shape)


def _covariance(advantages: jax.Array, log_prob: jax.Array, valid: jax.Array) -> jax.Array:
    """(A - mean A)·(log_prob - mean log_prob), the means over the valid tokens; [B, T]."""
    n = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    mean_adv = jnp.sum(jnp.where(valid, advantages, 0.0)) / n
    mean_log_prob = jnp.sum(jnp.where(valid, log_prob, 0.0)) / n
    return (advantages - mean_adv) * (log_prob - mean_log_prob)


def _select_clip_cov(old_log_prob, log_prob, advantages, response_mask, config: PolicyLossConfig,
                     key: jax.Array) -> jax.Array:
    """A uniformly random subset of min(k, #candidates) candidates: valid tokens that PPO's clip did
    not already clip and whose covariance lies strictly inside (clip_cov_lb, clip_cov_ub)."""
    old_log_prob, log_prob, adv = as_f32(*jax.lax.stop_gradient((old_log_prob, log_prob, advantages)))
    valid = response_mask != 0  # [B, T]
    pg_losses1, pg_losses2 = clipped_surrogates(adv, jnp.exp(log_prob - old_log_prob), config)
    clipped_by_ppo = pg_losses2 > pg_losses1
    cov = _covariance(adv, log_prob, valid)
    candidates = valid & ~clipped_by_ppo & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    k = _selection_count(config.clip_cov_ratio, jnp.sum(valid), valid.size)
    # A random permutation as priorities: the k candidates of lowest priority are a uniform subset.
    priority = jax.random.permutation(key, valid.size).reshape(valid.shape)  # [B, T]
    return candidates & _lowest_k(jnp.where(candidates, priority, valid.size), k)


def _select_kl_cov(log_prob, advantages, response_mask, config: PolicyLossConfig) -> jax.Array:
    """The k valid tokens of largest covariance."""
    log_prob, adv = as_f32(*jax.lax.stop_gradient((log_prob, advantages)))
    valid = response_mask != 0  # [B, T]
    cov = _covariance(adv, log_prob, valid)
    k = _selection_count(config.kl_cov_ratio, jnp.sum(valid), valid.size)
    return valid & _lowest_k(jnp.where(valid, -cov, jnp.inf), k)


def select_cov_tokens(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                      response_mask: jax.Array, config: PolicyLossConfig, key: jax.Array) -> jax.Array:
    """The tokens clip_cov or kl_cov (per `config.loss_mode`) treats specially, over the given batch.

    clip_cov: k = max(1, int(clip_cov_ratio · N)) tokens (N: response tokens), drawn uniformly with
    `key` from those PPO's clip leaves alone and whose covariance is in (clip_cov_lb, clip_cov_ub);
    fewer if there are fewer candidates. Their gradient is dropped. kl_cov: the k = max(1,
    int(kl_cov_ratio · N)) tokens of largest covariance; they get the |log-ratio| penalty. An empty
    batch selects nothing.

    Args:
      old_log_prob, log_prob, advantages: [B, T]; not differentiated.
      response_mask: [B, T] 0/1.
      config: static; `loss_mode` and the ratios/bounds of the loss.
      key: a jax PRNG key (clip_cov's random subset; kl_cov ignores it).
    Returns:
      [B, T] float32 0/1.
    """
    if config.loss_mode == "clip_cov":
        select = _select_clip_cov(old_log_prob, log_prob, advantages, response_mask, config, key)
    elif config.loss_mode == "kl_cov":
        select = _select_kl_cov(log_prob, advantages, response_mask, config)
    else:
        raise ValueError(f"select_cov_tokens is for loss_mode 'clip_cov' or 'kl_cov', got {config.loss_mode!r}")
    return select.astype(jnp.float32)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                                 response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                                 rollout_is_weights: jax.Array | None = None,
                                 token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """Clip-Cov: PPO clip (no dual clip), with the gradient of the selected tokens dropped.

    Per token, with r = exp(log_prob - old_log_prob) (unclamped, as in veRL):
      loss = max(-A·r, -A·clip(r, 1 - low, 1 + high)) · (1 - selected).

    Args:
      token_select: [B, T] 0/1, the mini-batch's clip_cov selection (`select_cov_tokens`) sliced to
        this micro-batch; None selects on these inputs with `jax.random.key(0)`.
      (the rest as in `policy_loss.compute_policy_loss_vanilla`)
    Returns:
      pg_loss, and metrics pg_clipfrac (the share of selected tokens) and ppo_kl.
    """
    if not config.clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {config.clip_cov_ratio}")
    if token_select is None:
        token_select = _select_clip_cov(old_log_prob, log_prob, advantages, response_mask, config,
                                        jax.random.key(0))
    selected = jax.lax.stop_gradient(jnp.asarray(token_select) != 0)  # [B, T]
    old_log_prob, log_prob, adv = as_f32(old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob  # [B, T]
    pg_losses1, pg_losses2 = clipped_surrogates(adv, jnp.exp(log_ratio), config)
    pg_losses = jnp.where(selected, 0.0, jnp.maximum(pg_losses1, pg_losses2))
    pg_losses = apply_is_weights(pg_losses, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, config.loss_agg_mode, norm=norm)
    metrics = {
        "pg_clipfrac": token_metric_mean(selected.astype(jnp.float32), response_mask, norm),
        "ppo_kl": token_metric_mean(jax.lax.stop_gradient(-log_ratio), response_mask, norm),
    }
    return pg_loss, metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                               response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                               rollout_is_weights: jax.Array | None = None,
                               token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """KL-Cov: the unclipped surrogate, plus ppo_kl_coef·|log-ratio| on the selected tokens.

    Per token, with d = log_prob - old_log_prob and r = exp(d) (both unclamped, as in veRL):
      loss = -A·r + selected · ppo_kl_coef · |d|.

    Args:
      token_select: [B, T] 0/1, the mini-batch's kl_cov selection (`select_cov_tokens`) sliced to this
        micro-batch; None selects on these inputs.
      (the rest as in `policy_loss.compute_policy_loss_vanilla`)
    Returns:
      pg_loss, and the metric ppo_kl, which for this loss is veRL's mean of |d|, not of -d.
    """
    if not config.kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {config.kl_cov_ratio}")
    if token_select is None:
        token_select = _select_kl_cov(log_prob, advantages, response_mask, config)
    selected = jax.lax.stop_gradient(jnp.asarray(token_select) != 0)  # [B, T]
    old_log_prob, log_prob, adv = as_f32(old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob  # [B, T]
    abs_kl = jnp.abs(log_ratio)
    pg_losses = -adv * jnp.exp(log_ratio) + jnp.where(selected, config.ppo_kl_coef * abs_kl, 0.0)
    pg_losses = apply_is_weights(pg_losses, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, config.loss_agg_mode, norm=norm)
    return pg_loss, {"ppo_kl": token_metric_mean(jax.lax.stop_gradient(abs_kl), response_mask, norm)}
