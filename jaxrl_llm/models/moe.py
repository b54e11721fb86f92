"""Qwen3-MoE's sparse MLP: a softmax router picks top-k SwiGLU experts per token.

Expert compute is grouped: the N·k (token, expert) pairs are sorted by expert and each expert's
contiguous block is multiplied by its own weights (one grouped matmul per projection): on GPUs with
the Pallas kernels of kernels/grouped_matmul.py, elsewhere with `jax.lax.ragged_dot` (XLA's GPU
lowering of ragged_dot pads every group to all the rows). Nothing is dense over experts: no loop
over E, no [N, E, ...] one-hot dispatch. FLOPs are those of the active experts only; the sort and
the two gathers are O(N·k·D) memory traffic.

Facts from transformers' Qwen3MoeSparseMoeBlock that parity depends on: router logits are
`x @ W_gate` in the compute dtype, the softmax is in fp32, top-k is taken on the probabilities,
`norm_topk_prob` renormalises the k chosen ones to sum to 1, and the weight scales each expert's
output after its down projection. The load-balancing loss is Switch Transformer's, summed over
all sparse layers' tokens as `load_balancing_loss_func` does (not a mean of per-layer losses).

Routing replay (`actor.router_replay.mode` R2/R3, veRL's names): the layer can be handed the expert
choices of another forward pass (the sampler's, or the old policy's) instead of taking its own top-k.
Only the discrete choice is replayed. The weights are the current router's softmax probabilities at
the replayed experts (renormalised under `norm_topk_prob`), so the router still gets gradients: what
veRL (through Megatron's routing replay), ms-swift and arXiv 2507.18071 do. A token whose replayed ids
hold a -1 (padding, or a position the recorder never ran, e.g. a response's last token) routes itself.

Shapes: N tokens, D model, E experts, k experts per token, I expert width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl_llm import sharding
from jaxrl_llm.models.layers import MLP, Linear
from kernels.grouped_matmul import grouped_matmul


def route(x: jax.Array, router_w: jax.Array, *, top_k: int, norm_topk_prob: bool,
          replay: jax.Array | None = None):
    """The router: which k experts serve each token, and with what weight.

    Args:
      x: [N, D] compute dtype; router_w: [D, E].
      replay: [N, k] int expert ids to use instead of the top-k (routing replay); a row holding a -1
        takes its own top-k.
    Returns:
      logits [N, E] (x's dtype), weights [N, k] (x's dtype), experts [N, k] int32.
    """
    logits = jnp.dot(x, router_w.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if replay is not None:
        replay = replay.astype(jnp.int32)
        given = jnp.all(replay >= 0, axis=-1, keepdims=True)  # [N, 1]
        experts = jnp.where(given, replay, experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)  # the live router's probabilities
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, weights.astype(x.dtype), experts.astype(jnp.int32)


def grouped_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_w: jax.Array, up_w: jax.Array,
                    down_w: jax.Array, layer: int | None = None) -> jax.Array:
    """Σ_j weights[:, j] · expert_{experts[:, j]}(x), with grouped matmuls over expert-sorted tokens.

    Args:
      x: [N, D]; weights: [N, k]; experts: [N, k] int32.
      gate_w, up_w: [E, D, I]; down_w: [E, I, D]; or, with `layer`, stacks [L, E, ...] of every layer's experts
        in x's dtype, of which this layer's are read in place (the sampler's frozen base: no copy of them).
    Returns:
      [N, D] in x's dtype.
    """
    n, d = x.shape
    k = experts.shape[1]
    num_experts = gate_w.shape[0 if layer is None else 1]
    flat = experts.reshape(-1)  # [N k]; an id >= E (another device's expert) sorts last and is skipped
    order = jnp.argsort(flat, stable=True)  # pair positions, grouped by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E], ids >= E dropped
    xs = jnp.take(x, order // k, axis=0)  # [N k, D]
    dt = x.dtype
    cast = (lambda w: w.astype(dt)) if layer is None else (lambda w: w)
    gate = grouped_matmul(xs, cast(gate_w), group_sizes, layer=layer)  # [N k, I]
    up = grouped_matmul(xs, cast(up_w), group_sizes, layer=layer)
    ys = grouped_matmul(jax.nn.silu(gate) * up, cast(down_w), group_sizes, layer=layer)  # [N k, D]
    in_group = jnp.arange(n * k) < jnp.sum(group_sizes)  # rows past the groups are not defined to be 0
    ys = jnp.where(in_group[:, None], ys * jnp.take(weights.reshape(-1), order)[:, None], 0)
    # Undo the sort with a gather (cheaper and deterministic, unlike a scatter-add), then sum the k.
    unsorted = jnp.take(ys, jnp.argsort(order), axis=0)  # [N k, D]
    return jnp.sum(unsorted.reshape(n, k, d), axis=1)


def expert_parallel_experts(x, weights, experts, gate_w, up_w, down_w):
    """`grouped_experts` with the experts split over the mesh's expert axis (expert parallelism).

    Each device of the expert axis holds E / ep experts. It gathers the tokens of its expert group
    (those the batch split over that axis), runs its own experts on the pairs routed to them, and a
    reduce-scatter sums the partial outputs back onto the devices that own the tokens. Without an
    expert axis in the ambient mesh this is `grouped_experts`.

    Args and returns as `grouped_experts`.
    """
    mesh = jax.sharding.get_abstract_mesh()
    axis = None if mesh.empty else sharding.expert_axis(mesh)
    if axis is None:
        return grouped_experts(x, weights, experts, gate_w, up_w, down_w)
    tok = sharding.logical_to_spec(("batch", None), x.shape, mesh)[0]  # how the tokens are split
    tok_axes = () if tok is None else (tok,) if isinstance(tok, str) else tuple(tok)
    gathered = axis in tok_axes
    rows, wspec = P(tok, None), P(axis, None, None)

    def local(x, weights, experts, gate_w, up_w, down_w):
        if gathered:
            x, weights, experts = (jax.lax.all_gather(a, axis, tiled=True) for a in (x, weights, experts))
        e_local = gate_w.shape[0]
        first = jax.lax.axis_index(axis) * e_local
        mine = (experts >= first) & (experts < first + e_local)
        y = grouped_experts(x, jnp.where(mine, weights, 0), jnp.where(mine, experts - first, e_local),
                            gate_w, up_w, down_w)
        if gathered:
            return jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, axis)

    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, wspec, wspec, wspec), out_specs=rows,
                         check_vma=False)(x, weights, experts, gate_w, up_w, down_w)


def router_stats(logits: jax.Array, experts: jax.Array, valid: jax.Array) -> jax.Array:
    """One layer's sums for the load-balancing loss, over valid tokens.

    Args:
      logits: [N, E]; experts: [N, k] (top-k of softmax(logits)); valid: [N] bool.
    Returns:
      [2, E + 1] fp32: row 0 = top-k assignments per expert, row 1 = summed router probabilities,
      last column = the number of valid tokens (in both rows).
    """
    num_experts = logits.shape[-1]
    w = valid.astype(jnp.float32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(
        jnp.repeat(w, experts.shape[1]))
    prob_sum = jnp.sum(probs * w[:, None], axis=0)
    n = jnp.sum(w)
    return jnp.stack([jnp.append(counts, n), jnp.append(prob_sum, n)])


def load_balancing_loss(stats: jax.Array) -> jax.Array:
    """E · Σ_e f_e · P_e from `router_stats` summed over the sparse layers ([2, E + 1])."""
    num_experts = stats.shape[-1] - 1
    rows = jnp.maximum(stats[0, -1], 1.0)
    return num_experts * jnp.sum((stats[0, :-1] / rows) * (stats[1, :-1] / rows))


def moe_mlp(x: jax.Array, valid: jax.Array | None, router_w, gate_w, up_w, down_w, *, top_k: int,
            norm_topk_prob: bool, expert_parallel: bool = False, replay: jax.Array | None = None,
            layer: int | None = None):
    """The sparse MLP on [..., D] tokens -> ([..., D], router_stats [2, E + 1], experts [..., k] int32).

    valid: [...] bool or None. `expert_parallel`: split the experts over the mesh's expert axis (the
    trainer; the sampler keeps its weights whole on that axis). `replay`: [..., k] expert ids to use
    (see `route`); the returned experts are the ones used, for recording. `layer`: the expert weights are
    stacks of every layer's, read in place (`grouped_experts`; the sampler only).
    """
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    flat_replay = None if replay is None else replay.reshape(-1, top_k)
    logits, weights, experts = route(flat, router_w, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                     replay=flat_replay)
    if expert_parallel:
        y = expert_parallel_experts(flat, weights, experts, gate_w, up_w, down_w)
    else:
        y = grouped_experts(flat, weights, experts, gate_w, up_w, down_w, layer)
    valid = jnp.ones(flat.shape[:1], bool) if valid is None else valid.reshape(-1)
    return y.reshape(*lead, -1), router_stats(logits, experts, valid), experts.reshape(*lead, top_k)


class Router(nnx.Module):
    """`mlp.gate`: kernel [D, E] (HF stores [E, D])."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.kernel = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.num_experts), jnp.dtype(cfg.param_dtype)))


class Experts(nnx.Module):
    """`mlp.experts`: the E experts' SwiGLU weights stacked on a leading axis (HF stores one tensor each)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        e, d, i, dt = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, jnp.dtype(cfg.param_dtype)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, i), dt))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, i), dt))
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, d), dt))


class SparseMoeBlock(nnx.Module):
    """Router plus experts: `__call__(x [B, T, D], valid [B, T], replay [B, T, k]) -> ([B, T, D],
    router_stats, experts [B, T, k])`. Qwen3.5-MoE (`cfg.shared_expert_intermediate_size`) adds a shared
    SwiGLU expert every token goes through, scaled by sigmoid(shared_expert_gate(x)) [B, T, 1]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.dtype = jnp.dtype(cfg.dtype)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, rngs=rngs, width=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, use_bias=False, cfg=cfg, rngs=rngs,
                                             name="shared_expert_gate")
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x: jax.Array, valid: jax.Array | None = None, replay: jax.Array | None = None):
        ex = self.experts
        x = x.astype(self.dtype)
        y, stats, experts = moe_mlp(x, valid, self.gate.kernel[...], ex.gate_proj[...],
                                    ex.up_proj[...], ex.down_proj[...], top_k=self.top_k,
                                    norm_topk_prob=self.norm_topk_prob, expert_parallel=True, replay=replay)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return sharding.constrain(y, ("batch", "length", "act_embed")), stats, experts
