"""veRL's other policy losses: gspo, sapo, gpg, geo_mean, cispo, dppo_tv, dppo_kl and dro.

Each has the shared signature of `policy_loss.PolicyLossFn` and follows veRL 0.9.1's formula, clamps
and metrics for its name. Where veRL reports a metric as a constant zero "for compatibility" we
return 0.0 too; where veRL omits a metric we omit it. Token-level metrics are means over the
response tokens, divided by `norm.num_tokens` under micro-batching, so they add up over the
micro-batches of a mini-batch like the losses do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.algorithms.aggregation import LossNorm, agg_loss, compute_loss_norm, token_metric_mean
from jaxrl_llm.algorithms.policy_loss import (
    PolicyLossConfig,
    apply_is_weights,
    as_f32,
    clamped_log_ratio,
    clipped_surrogates,
    register_policy_loss,
)

Metrics = dict[str, jax.Array]

# veRL caps GSPO's per-token log sequence ratio from above only.
_GSPO_LOG_RATIO_MAX = 10.0


def _zero() -> jax.Array:
    return jnp.zeros((), jnp.float32)


def _frac(flags: jax.Array, mask: jax.Array, norm: LossNorm | None) -> jax.Array:
    """Fraction of response tokens where the boolean `flags` [B, T] hold."""
    return token_metric_mean(flags.astype(jnp.float32), mask, norm)


def _ppo_kl(log_ratio: jax.Array, mask: jax.Array, norm: LossNorm | None) -> jax.Array:
    """veRL's ppo_kl metric: the token mean of old_log_prob - log_prob (k1 estimate of KL(old || new))."""
    return token_metric_mean(jax.lax.stop_gradient(-log_ratio), mask, norm)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                             response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                             rollout_is_weights: jax.Array | None = None,
                             token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """GSPO (https://arxiv.org/abs/2507.18071): PPO clip on a sequence-level ratio.

    The ratio of sequence i is s_i = exp(mean over its tokens of (log_prob - old_log_prob)), unclamped
    in the mean. Each token uses s_i as its value but carries its own log-prob gradient:
    log s_it = sg(log s_i) + log_prob_t - sg(log_prob_t), clamped at 10 from above. The per-token
    loss is max(-A·s_it, -A·clip(s_it, 1 - low, 1 + high)), aggregated with `config.loss_agg_mode`
    (the paper's choice is "seq-mean-token-mean"). A sequence is never split across micro-batches,
    so s_i is the same under micro-batching.

    Returns:
      pg_loss, and metrics pg_clipfrac, ppo_kl (of the unclamped token log-ratio) and
      pg_clipfrac_lower (always 0, as in veRL).
    """
    del token_select
    old_log_prob, log_prob, adv = as_f32(old_log_prob, log_prob, advantages)
    mask = (response_mask != 0).astype(jnp.float32)  # [B, T]
    log_ratio = log_prob - old_log_prob  # [B, T]
    seq_len = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)  # [B]
    seq_log_ratio = jnp.sum(jnp.where(mask > 0, log_ratio, 0.0), axis=-1) / seq_len  # [B]
    log_seq_ratio = log_prob - jax.lax.stop_gradient(log_prob) + jax.lax.stop_gradient(seq_log_ratio)[:, None]
    seq_ratio = jnp.exp(jnp.minimum(log_seq_ratio, _GSPO_LOG_RATIO_MAX))  # [B, T]

    pg_losses1, pg_losses2 = clipped_surrogates(adv, seq_ratio, config)
    pg_losses = apply_is_weights(jnp.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, config.loss_agg_mode, norm=norm)
    metrics = {
        "pg_clipfrac": _frac(pg_losses2 > pg_losses1, response_mask, norm),
        "ppo_kl": _ppo_kl(log_ratio, response_mask, norm),
        "pg_clipfrac_lower": _zero(),
    }
    return pg_loss, metrics


@register_policy_loss("sapo")
def compute_policy_loss_sapo(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                             response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                             rollout_is_weights: jax.Array | None = None,
                             token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """SAPO (https://arxiv.org/abs/2511.20347): a smooth sigmoid gate in place of the hard clip.

    Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)) and tau = tau_pos if A > 0 else
    tau_neg: loss = -A · sigmoid(tau·(r - 1)) · 4 / tau. The gate equals r to first order at r = 1
    and flattens away from it, so far off-policy tokens get small, not zero, gradients.

    Always aggregated with "seq-mean-token-mean", as veRL does, whatever `config.loss_agg_mode` says.

    Returns:
      pg_loss, and metrics ppo_kl, pg_clipfrac and pg_clipfrac_lower (both always 0, as in veRL).
    """
    del token_select
    old_log_prob, log_prob, adv = as_f32(old_log_prob, log_prob, advantages)
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)  # [B, T]
    ratio = jnp.exp(log_ratio)
    taus = jnp.where(adv > 0, config.tau_pos, config.tau_neg)  # [B, T]
    gates = jax.nn.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = apply_is_weights(-gates * adv, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", norm=norm)
    metrics = {"pg_clipfrac": _zero(), "ppo_kl": _ppo_kl(log_ratio, response_mask, norm),
               "pg_clipfrac_lower": _zero()}
    return pg_loss, metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                            response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                            rollout_is_weights: jax.Array | None = None,
                            token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """GPG (https://arxiv.org/abs/2504.02546): plain policy gradient, loss = -A · log_prob per token.

    No ratio and no clip; `old_log_prob` is unused. veRL reports no metrics for it.
    """
    del old_log_prob, token_select
    log_prob, adv = as_f32(log_prob, advantages)
    pg_losses = apply_is_weights(-log_prob * adv, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, config.loss_agg_mode, norm=norm), {}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                                 response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                                 rollout_is_weights: jax.Array | None = None,
                                 token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """GMPO (https://arxiv.org/abs/2507.20673): PPO on the geometric mean of the token ratios.

    Per token the log-ratio d = log_prob - old_log_prob (unclamped) is clipped to [-low, high] on the
    side that helps the objective: sign(A)·min(sign(A)·d, sign(A)·clip(d, -low, high)). Sequence i
    gets ratio_i = exp(mean of the clipped d over its tokens), advantage Ā_i = mean of A over its
    tokens (sequence-level advantages are assumed, as in veRL), loss_i = -Ā_i · ratio_i. Rollout
    weights enter as their per-sequence geometric mean, exp(mean of log(w + 1e-10)).

    The loss is the mean of loss_i over sequences, whatever `config.loss_agg_mode` says. Deviation:
    veRL takes torch.mean over all rows, so an all-masked row adds 0 but counts in the denominator;
    here it is not counted (the same choice as `aggregation` for empty rows), and under
    micro-batching the sum is divided by `norm.num_seqs`, the mini-batch's non-empty sequences.

    Returns:
      pg_loss, and metrics pg_clipfrac (tokens with A > 0 whose d left the clip range),
      pg_clipfrac_lower (the same for A < 0) and ppo_kl.
    """
    del token_select
    old_log_prob, log_prob, adv = as_f32(old_log_prob, log_prob, advantages)
    mask = (response_mask != 0).astype(jnp.float32)  # [B, T]
    log_ratio = jnp.where(mask > 0, log_prob - old_log_prob, 0.0)  # [B, T]
    sign = jnp.sign(adv)
    log_ratio_clip = jnp.clip(log_ratio, -config.clip_ratio_low, config.clip_ratio_high)
    log_ratio_min = sign * jnp.minimum(sign * log_ratio, sign * log_ratio_clip)  # [B, T]

    seq_len = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)  # [B]
    seq_ratio = jnp.exp(jnp.sum(log_ratio_min * mask, axis=-1) / seq_len)  # [B]
    seq_adv = jnp.sum(jnp.where(mask > 0, adv, 0.0), axis=-1) / seq_len  # [B]
    pg_losses = -seq_adv * seq_ratio  # [B]
    if rollout_is_weights is not None:
        log_w = jnp.log(jax.lax.stop_gradient(jnp.asarray(rollout_is_weights, jnp.float32)) + 1e-10)
        pg_losses = pg_losses * jnp.exp(jnp.sum(jnp.where(mask > 0, log_w, 0.0), axis=-1) / seq_len)
    num_seqs = compute_loss_norm(mask).num_seqs if norm is None else norm.num_seqs
    # Empty rows have seq_adv = 0, so they add nothing to the sum.
    pg_loss = jnp.sum(pg_losses) / num_seqs

    clipped = log_ratio != log_ratio_clip
    metrics = {
        "pg_clipfrac": _frac(clipped & (adv > 0), response_mask, norm),
        "ppo_kl": _ppo_kl(log_ratio, response_mask, norm),
        "pg_clipfrac_lower": _frac(clipped & (adv < 0), response_mask, norm),
    }
    return pg_loss, metrics


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                              response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                              rollout_is_weights: jax.Array | None = None,
                              token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """CISPO (https://arxiv.org/abs/2506.13585): REINFORCE weighted by the clipped, detached ratio.

    Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)):
      loss = -sg(clip(r, 1 - low, 1 + high)) · A · log_prob,
    so every token keeps a gradient, -sg(clip(r))·A (times the aggregation weight), unlike PPO's clip
    which zeroes it.

    Returns:
      pg_loss, and metrics pg_clipfrac (tokens whose ratio was clipped), ppo_kl and
      pg_clipfrac_lower (always 0, as in veRL).
    """
    del token_select
    old_log_prob, log_prob, adv = as_f32(old_log_prob, log_prob, advantages)
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)  # [B, T]
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses = apply_is_weights(-jax.lax.stop_gradient(clipped_ratio) * adv * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, config.loss_agg_mode, norm=norm)
    metrics = {
        "pg_clipfrac": _frac(ratio != clipped_ratio, response_mask, norm),
        "ppo_kl": _ppo_kl(log_ratio, response_mask, norm),
        "pg_clipfrac_lower": _zero(),
    }
    return pg_loss, metrics


def _dppo(old_log_prob, log_prob, advantages, response_mask, config, norm, rollout_is_weights, valid_fn):
    """DPPO's shared body: a truncated, detached ratio times log_prob, on the tokens `valid_fn` keeps."""
    old_log_prob, log_prob, adv = as_f32(old_log_prob, log_prob, advantages)
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)  # [B, T]
    ratio = jnp.exp(log_ratio)
    # Truncated importance sampling in place of the dual clip; veRL reuses clip_ratio_c as the cap.
    truncated_ratio = jax.lax.stop_gradient(jnp.minimum(ratio, config.clip_ratio_c))
    prob, old_prob = jnp.exp(log_prob), jnp.exp(old_log_prob)
    valid_pos, valid_neg = valid_fn(prob, old_prob, log_prob, old_log_prob)
    valid = jax.lax.stop_gradient(jnp.where(adv > 0, valid_pos, valid_neg).astype(jnp.float32))  # [B, T]

    pg_losses = apply_is_weights(-adv * truncated_ratio * log_prob * valid, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, config.loss_agg_mode, norm=norm)
    metrics = {
        "pg_clipfrac": token_metric_mean(1.0 - valid, response_mask, norm),
        "ppo_kl": _ppo_kl(log_ratio, response_mask, norm),
        "pg_clipfrac_lower": token_metric_mean((ratio > config.clip_ratio_c) * valid, response_mask, norm),
    }
    return pg_loss, metrics


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                                response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                                rollout_is_weights: jax.Array | None = None,
                                token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """DPPO-Binary-TV (https://arxiv.org/abs/2602.04879): a trust region on the probability change.

    Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)) and p, p_old the token
    probabilities: loss = -A · sg(min(r, clip_ratio_c)) · log_prob · valid, where valid (detached)
    is p - p_old <= clip_ratio_high for A > 0 and p - p_old >= -clip_ratio_low otherwise. The
    clip ratios are thresholds on the total-variation change here, not ratio ranges.

    Returns:
      pg_loss, and metrics pg_clipfrac (tokens outside the trust region), pg_clipfrac_lower (valid
      tokens whose ratio was truncated) and ppo_kl.
    """
    del token_select

    def valid_fn(prob, old_prob, log_prob, old_log_prob):
        return prob - old_prob <= config.clip_ratio_high, prob - old_prob >= -config.clip_ratio_low

    return _dppo(old_log_prob, log_prob, advantages, response_mask, config, norm, rollout_is_weights, valid_fn)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                                response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                                rollout_is_weights: jax.Array | None = None,
                                token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """DPPO-Binary-KL (https://arxiv.org/abs/2602.04879): a trust region on a binary KL.

    As dppo_tv, with valid decided by the KL between Bernoulli(p_old) and Bernoulli(p),
      kl = p_old·(log p_old - log p) + (1 - p_old)·log((1 - p_old + 1e-8) / (1 - p + 1e-8)):
    for A > 0 a token is valid if kl <= clip_ratio_high or p <= p_old (moving the wrong way is
    always allowed); for A <= 0 if kl <= clip_ratio_low or p >= p_old.
    """
    del token_select

    def valid_fn(prob, old_prob, log_prob, old_log_prob):
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * jnp.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        return ((binary_kl <= config.clip_ratio_high) | (prob <= old_prob),
                (binary_kl <= config.clip_ratio_low) | (prob >= old_prob))

    return _dppo(old_log_prob, log_prob, advantages, response_mask, config, norm, rollout_is_weights, valid_fn)


@register_policy_loss("dro")
def compute_policy_loss_dro(old_log_prob: jax.Array, log_prob: jax.Array, advantages: jax.Array,
                            response_mask: jax.Array, *, config: PolicyLossConfig, norm: LossNorm | None = None,
                            rollout_is_weights: jax.Array | None = None,
                            token_select: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """DRO (Direct Reward Optimization): policy gradient with a quadratic log-ratio penalty.

    Per token, with d = log_prob - old_log_prob (unclamped): loss = -(A · log_prob - beta/2 · d²),
    beta = `config.dro_beta` (required, > 0). The gradient is -A + beta·d.

    Returns:
      pg_loss, and the metric ppo_kl.
    """
    del token_select
    beta = config.dro_beta
    if beta is None or not beta > 0:
        raise ValueError(f"policy loss 'dro' needs a positive dro_beta, got {beta}")
    old_log_prob, log_prob, adv = as_f32(old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob  # [B, T]
    pg_losses = apply_is_weights(-(log_prob * adv - 0.5 * beta * jnp.square(log_ratio)), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, config.loss_agg_mode, norm=norm)
    return pg_loss, {"ppo_kl": _ppo_kl(log_ratio, response_mask, norm)}
