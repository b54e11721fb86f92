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
    PolicyLossConfig,
    agg_loss,
    compute_kl_loss,
    compute_token_logprobs,
    compute_value_loss,
    get_policy_loss_fn,
    token_metric_mean,
)
from jaxrl_llm.models.lora import combine, is_adapter, partition
from jaxrl_llm.models.moe import load_balancing_loss


@dataclasses.dataclass(frozen=True)
class ActorLossSettings:
    """Static hyperparameters of the actor loss (part of the compiled program)."""

    temperature: float = 1.0
    policy: PolicyLossConfig = PolicyLossConfig()  # the policy loss (`actor.policy_loss.loss_mode`) and its knobs
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    chunk_size: int = 8192
    on_policy: bool = False  # one mini-batch, one epoch: the old log-probs are the current ones
    router_aux_loss_coef: float = 0.0  # MoE load-balancing loss weight (model's output_router_logits)


def gather_response(packed: jax.Array, resp_pos: jax.Array) -> jax.Array:
    """packed [rows, L] per-token values -> [S, Tr] at each response token's predicting position."""
    return jnp.take(packed.reshape(-1), resp_pos, axis=0)


def token_logprobs(model, mb, *, temperature: float, chunk_size: int, with_entropy: bool = False,
                   with_sum_pi_squared: bool = False, with_router_aux: bool = False,
                   with_routing: bool = False) -> dict[str, jax.Array]:
    """Per-token outputs of every response token under `model`, never forming [N, V] logits.

    A MoE replays the routing in `mb["routed_experts"]` ([rows, L, L_moe, k], routing replay) when the
    micro-batch carries it.

    Returns:
      {"log_prob": [S, Tr]} float32, plus "entropy" and "sum_pi_squared" (Σ_v π(v)², forward only) [S, Tr]
      when asked for, (`with_router_aux`, a MoE) the scalar "router_aux_loss" over the packed tokens, and
      (`with_routing`) "routing", the experts every packed token used [rows, L, L_moe, k] int16.
    """
    model_out = model.hidden_states(mb["input_ids"], mb["positions"], segment_ids=mb["segment_ids"],
                                    with_router_stats=with_router_aux, routed_experts=mb.get("routed_experts"),
                                    with_routing=with_routing)
    hidden, aux = (model_out[0] if isinstance(model_out, tuple) else model_out), None  # [rows, L, D]
    if with_router_aux:
        aux = load_balancing_loss(model_out[1])
    outs = compute_token_logprobs(hidden, model.lm_head_weight(), mb["targets"], temperature=temperature,
                                  chunk_size=chunk_size, with_entropy=with_entropy,
                                  with_sum_pi_squared=with_sum_pi_squared)  # each [rows, L]
    out = {"log_prob": gather_response(outs[0], mb["resp_pos"])}
    if with_entropy:
        out["entropy"] = gather_response(outs[1], mb["resp_pos"])
    if with_sum_pi_squared:
        out["sum_pi_squared"] = gather_response(outs[-1], mb["resp_pos"])
    if aux is not None:
        out["router_aux_loss"] = aux
    if with_routing:
        out["routing"] = model_out[-1].astype(jnp.int16)
    return out


def values(critic, mb) -> jax.Array:
    """Critic values [S, Tr]: V of the state before each response token (veRL's alignment)."""
    v = critic(mb["input_ids"], mb["positions"], segment_ids=mb["segment_ids"])  # [rows, L]
    return gather_response(v, mb["resp_pos"])


def make_logprob_fn(graphdef, *, temperature: float, chunk_size: int, with_entropy: bool = False,
                    with_sum_pi_squared: bool = False, with_routing: bool = False):
    """(params, mb) -> {"log_prob": [S, Tr], "entropy": [S, Tr]?, "sum_pi_squared": [S, Tr]?, "routing"?} for
    the old/ref log-prob passes (Σ_v π(v)², forward only, for the optimal-token-baseline estimators; the
    packed routing for routing replay R2)."""

    def fn(params, mb):
        return token_logprobs(nnx.merge(graphdef, params), mb, temperature=temperature, chunk_size=chunk_size,
                              with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared,
                              with_routing=with_routing)

    return jax.jit(fn)


def make_old_and_ref_fn(actor_graphdef, ref_graphdef, *, temperature: float, chunk_size: int,
                        with_sum_pi_squared: bool = False, with_routing: bool = False, ref_in_actor: bool = False):
    """(actor_params, ref_params, mb) -> the old pass's outputs (`make_logprob_fn`'s, with the entropy) and
    "ref_log_prob" [S, Tr]: both models' forward passes over one micro-batch in one program, each the same
    computation as its own pass.

    `ref_in_actor` (LoRA, where the reference is the actor's frozen base): (actor_params, mb), the reference run on
    the actor's leaves that are not adapters. The base is then one argument, not two: XLA sizes a program by its
    arguments, so the same arrays passed twice counted twice (Qwen3.5-35B-A3B's 69.3 GB bf16 base as 138.9 GB of
    inputs and outputs, past an H200's 138.1 GB, in XLA's scheduler)."""

    def fn(actor_params, ref_params, mb):
        out = token_logprobs(nnx.merge(actor_graphdef, actor_params), mb, temperature=temperature,
                             chunk_size=chunk_size, with_entropy=True, with_sum_pi_squared=with_sum_pi_squared,
                             with_routing=with_routing)
        ref = token_logprobs(nnx.merge(ref_graphdef, ref_params), mb, temperature=temperature, chunk_size=chunk_size)
        return {**out, "ref_log_prob": ref["log_prob"]}

    if ref_in_actor:
        return jax.jit(lambda actor_params, mb: fn(actor_params, partition(actor_params, is_adapter)[1], mb))
    return jax.jit(fn)


def make_value_fn(graphdef):
    """(params, mb) -> {"values": [S, Tr]}."""
    return jax.jit(lambda params, mb: {"values": values(nnx.merge(graphdef, params), mb)})


def _actor_key(key: str) -> str:
    """veRL's name of a policy-loss metric: `actor/<key>`, but rollout correction's own `rollout_corr/...`
    keys keep their prefix."""
    return key if "/" in key else f"actor/{key}"


def actor_loss(params, graphdef, mb, norm: LossNorm, s: ActorLossSettings):
    """The actor loss of one micro-batch (already divided by the mini-batch's denominators).

    Optional fields of `mb`: `loss_mask` (the response mask less the tokens that rollout correction
    rejected), `rollout_is_weights` (its importance weights), `token_select` (the mini-batch's token
    selection of the clip_cov / kl_cov losses).
    """
    model = nnx.merge(graphdef, params)
    outs = token_logprobs(model, mb, temperature=s.temperature, chunk_size=s.chunk_size, with_entropy=True,
                          with_router_aux=s.router_aux_loss_coef > 0)
    logp, ent = outs["log_prob"], outs["entropy"]
    mask = mb.get("loss_mask", mb["response_mask"])
    old = jax.lax.stop_gradient(logp) if s.on_policy else mb["old_log_prob"]
    agg_mode = s.policy.loss_agg_mode
    pg_loss, pg_metrics = get_policy_loss_fn(s.policy.loss_mode)(
        old, logp, mb["advantages"], mask, config=s.policy, norm=norm,
        rollout_is_weights=mb.get("rollout_is_weights"), token_select=mb.get("token_select"))
    entropy = agg_loss(ent, mask, agg_mode, norm=norm)
    loss = pg_loss - s.entropy_coeff * entropy
    metrics = {"actor/pg_loss": pg_loss, "actor/entropy": jax.lax.stop_gradient(entropy),
               **{_actor_key(k): v for k, v in pg_metrics.items()}}
    if s.use_kl_loss:
        kl = compute_kl_loss(logp, mb["ref_log_prob"], mask, s.kl_loss_type, agg_mode, norm=norm)
        loss = loss + s.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl
    if s.router_aux_loss_coef > 0:
        # The load-balancing loss of this micro-batch's tokens, weighted by its share of the mini-batch's
        # loss tokens so that micro-batches add up (like transformers, one loss per forward).
        aux = outs["router_aux_loss"] * jnp.sum(mask) / norm.num_tokens
        loss = loss + s.router_aux_loss_coef * aux
        metrics["actor/router_aux_loss"] = jax.lax.stop_gradient(aux)
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


def metric_combiner(key: str):
    """How a metric combines over micro-batches and mini-batches: keys ending in `_max` (or rollout
    correction's `_max_deviation`) take the max, `_min` the min; every other metric is additive over
    micro-batches (divided by the mini-batch's denominators) and averaged over mini-batches."""
    if key.endswith(("_max", "_max_deviation")):
        return jnp.maximum
    if key.endswith("_min"):
        return jnp.minimum
    return None


def _accumulate(acc, new):
    out = {}
    for k, v in new.items():
        combine = metric_combiner(k)
        out[k] = acc[k] + v if combine is None else combine(acc[k], v)
    return out


def make_grad_step(loss_fn, graphdef, param_shardings, **loss_kwargs):
    """Jitted (params, frozen, grads_acc, metrics_acc, mb, norm) -> (grads_acc, metrics_acc).

    Gradients are taken for `params` (the trained leaves) only; `frozen` (the LoRA base, or {} in full
    fine-tuning) joins them in the model. The accumulators are donated, so accumulation happens in place.
    """

    def step(params, frozen, grads_acc, metrics_acc, mb, norm):
        loss = lambda p: loss_fn(combine(frozen, p), graphdef, mb, norm, **loss_kwargs)
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads)
        return grads_acc, _accumulate(metrics_acc, metrics)

    return jax.jit(step, donate_argnums=(2, 3), out_shardings=(param_shardings, None))


def make_metrics_init(loss_fn, graphdef, **loss_kwargs):
    """Zero metric accumulators with the loss's metric keys. The structure comes from one
    `eval_shape` (no compute) and is cached, so steady-state steps trace nothing."""
    cache = {}

    def init(params, mb, norm):
        key = tuple(sorted(mb))
        if key not in cache:
            _, metrics = jax.eval_shape(lambda p: loss_fn(p, graphdef, mb, norm, **loss_kwargs), params)
            cache[key] = {k: (v.shape, v.dtype) for k, v in metrics.items()}
        # max-like metrics start at -inf, min-like at +inf, additive ones at 0
        start = lambda k: {jnp.maximum: -jnp.inf, jnp.minimum: jnp.inf}.get(metric_combiner(k), 0.0)
        return {k: jnp.full(shape, start(k), dtype) for k, (shape, dtype) in cache[key].items()}

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
