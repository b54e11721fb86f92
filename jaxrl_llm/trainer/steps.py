"""Jitted per-micro-batch computations: token logprobs, values, and the actor/critic updates.

Every function here is pure. The model runs on packed rows; its per-token outputs are gathered to
response layout with `resp_pos`, where the veRL losses apply unchanged. A mini-batch is the sum of
its micro-batches: each micro-batch loss is normalised by the mini-batch's `LossNorm`, so
accumulated gradients equal one step on the whole mini-batch.

Shapes: rows x L packed tokens; S sequence slots x Tr response tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl_llm.algorithms import (
    LossNorm,
    agg_loss,
    compute_kl_loss,
    compute_policy_loss_vanilla,
    compute_token_logprobs,
    compute_value_loss,
    token_metric_mean,
)


@dataclasses.dataclass(frozen=True)
class ActorLossSettings:
    """Static hyperparameters of the actor loss (part of the compiled program)."""

    temperature: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    chunk_size: int = 8192
    on_policy: bool = False  # one mini-batch, one epoch: the old log-probs are the current ones


def gather_response(packed: jax.Array, resp_pos: jax.Array) -> jax.Array:
    """packed [rows, L] per-token values -> [S, Tr] at each response token's predicting position."""
    return jnp.take(packed.reshape(-1), resp_pos, axis=0)


def token_logprobs(model, mb, *, temperature: float, chunk_size: int, with_entropy: bool):
    """Log-prob (and entropy) of every response token under `model`, never forming [N, V] logits.

    Returns:
      logprobs [S, Tr] float32, entropy [S, Tr] float32 or None.
    """
    hidden = model.hidden_states(mb["input_ids"], mb["positions"], segment_ids=mb["segment_ids"])  # [rows, L, D]
    logp, ent = compute_token_logprobs(hidden, model.lm_head_weight(), mb["targets"], temperature=temperature,
                                       chunk_size=chunk_size, with_entropy=with_entropy)  # [rows, L]
    logp = gather_response(logp, mb["resp_pos"])
    return logp, (gather_response(ent, mb["resp_pos"]) if with_entropy else None)


def values(critic, mb) -> jax.Array:
    """Critic values [S, Tr]: V of the state before each response token (veRL's alignment)."""
    v = critic(mb["input_ids"], mb["positions"], segment_ids=mb["segment_ids"])  # [rows, L]
    return gather_response(v, mb["resp_pos"])


def make_logprob_fn(graphdef, *, temperature: float, chunk_size: int, with_entropy: bool = False):
    """(params, mb) -> {"log_prob": [S, Tr], "entropy": [S, Tr]?} for old/ref log-probs."""

    def fn(params, mb):
        model = nnx.merge(graphdef, params)
        logp, ent = token_logprobs(model, mb, temperature=temperature, chunk_size=chunk_size,
                                   with_entropy=with_entropy)
        out = {"log_prob": logp}
        if with_entropy:
            out["entropy"] = ent
        return out

    return jax.jit(fn)


def make_value_fn(graphdef):
    """(params, mb) -> {"values": [S, Tr]}."""
    return jax.jit(lambda params, mb: {"values": values(nnx.merge(graphdef, params), mb)})


def actor_loss(params, graphdef, mb, norm: LossNorm, s: ActorLossSettings):
    """The actor loss of one micro-batch (already divided by the mini-batch's denominators)."""
    model = nnx.merge(graphdef, params)
    logp, ent = token_logprobs(model, mb, temperature=s.temperature, chunk_size=s.chunk_size, with_entropy=True)
    mask = mb["response_mask"]
    old = jax.lax.stop_gradient(logp) if s.on_policy else mb["old_log_prob"]
    pg_loss, pg_metrics = compute_policy_loss_vanilla(
        old, logp, mb["advantages"], mask, clip_ratio_low=s.clip_ratio_low,
        clip_ratio_high=s.clip_ratio_high, clip_ratio_c=s.clip_ratio_c, loss_agg_mode=s.loss_agg_mode, norm=norm)
    entropy = agg_loss(ent, mask, s.loss_agg_mode, norm=norm)
    loss = pg_loss - s.entropy_coeff * entropy
    metrics = {"actor/pg_loss": pg_loss, "actor/entropy": jax.lax.stop_gradient(entropy),
               **{f"actor/{k}": v for k, v in pg_metrics.items()}}
    if s.use_kl_loss:
        kl = compute_kl_loss(logp, mb["ref_log_prob"], mask, s.kl_loss_type, s.loss_agg_mode, norm=norm)
        loss = loss + s.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl
    if "rollout_log_probs" in mb:
        # Trainer-sampler mismatch on this micro-batch's tokens (mean is additive; max is maxed).
        gap = jnp.abs(jax.lax.stop_gradient(logp) - mb["rollout_log_probs"])
        metrics["actor/logprob_gap_mean"] = token_metric_mean(gap, mask, norm)
        metrics["actor/logprob_gap_max"] = jnp.max(jnp.where(mask > 0, gap, 0.0))
    return loss, metrics


def critic_loss(params, graphdef, mb, norm: LossNorm, *, cliprange_value: float, loss_agg_mode: str):
    critic = nnx.merge(graphdef, params)
    vpreds = values(critic, mb)
    mask = mb["response_mask"]
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, mb["returns"], mb["values"], mask, cliprange_value,
                                              loss_agg_mode, norm=norm)
    metrics = {"critic/vf_loss": vf_loss, "critic/vf_clipfrac": vf_clipfrac,
               "critic/vpred_mean": token_metric_mean(jax.lax.stop_gradient(vpreds), mask, norm)}
    return vf_loss, metrics


_MAX_METRICS = ("actor/logprob_gap_max",)


def _accumulate(acc, new):
    return {k: (jnp.maximum(acc[k], v) if k in _MAX_METRICS else acc[k] + v) for k, v in new.items()}


def make_grad_step(loss_fn, graphdef, param_shardings, **loss_kwargs):
    """Jitted (params, grads_acc, metrics_acc, mb, norm) -> (grads_acc, metrics_acc).

    The accumulators are donated, so accumulation happens in place.
    """

    def step(params, grads_acc, metrics_acc, mb, norm):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, graphdef, mb, norm, **loss_kwargs)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads)
        return grads_acc, _accumulate(metrics_acc, metrics)

    return jax.jit(step, donate_argnums=(1, 2), out_shardings=(param_shardings, None))


def make_metrics_init(loss_fn, graphdef, **loss_kwargs):
    """Zero metric accumulators with the loss's metric keys. The structure comes from one
    `eval_shape` (no compute) and is cached, so steady-state steps trace nothing."""
    cache = {}

    def init(params, mb, norm):
        key = tuple(sorted(mb))
        if key not in cache:
            _, metrics = jax.eval_shape(lambda p: loss_fn(p, graphdef, mb, norm, **loss_kwargs), params)
            cache[key] = {k: (v.shape, v.dtype) for k, v in metrics.items()}
        return {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in cache[key].items()}

    return init


def make_zeros(shardings):
    """Jitted zeros with the params' structure and shardings (the gradient accumulator)."""
    return jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t), out_shardings=shardings)


def make_apply_step(tx: optax.GradientTransformation, state_shardings):
    """Jitted (state, grads) -> (state, metrics): one optimizer update, skipped if not finite.

    A NaN/Inf gradient leaves params and optimizer state bit-identical and bumps `skipped`.
    """

    def apply(state, grads):
        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        new_state = {"params": keep(params, state["params"]), "opt_state": keep(opt_state, state["opt_state"]),
                     "step": state["step"] + ok.astype(jnp.int32),
                     "skipped": state["skipped"] + (~ok).astype(jnp.int32)}
        return new_state, {"grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32)}

    return jax.jit(apply, donate_argnums=(0,), out_shardings=(state_shardings, None))
