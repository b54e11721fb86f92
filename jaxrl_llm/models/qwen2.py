"""The decoder of every supported family (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama 3.x) in Flax NNX.

One model, with the family's switches read from its config (`families.py`): biases on q/k/v
(Qwen2), a per-head RMSNorm on q and k before RoPE (Qwen3), Llama 3's scaled RoPE frequencies
(`rope.py`), routed experts in the sparse layers (Qwen3-MoE, `moe.py`), an explicit head_dim and a
tied or untied head (all).

Module and parameter names follow HF (`model.layers.self_attn.q_proj.kernel`), so the HF table in
`hf_table.py` is mostly renames. Decoder layers are stacked on a leading axis and run with
`lax.scan`, which keeps compile time flat in depth and lets remat wrap one layer. A MoE with dense
layers among its sparse ones keeps one stack per kind and scans them in runs (`cfg.layer_runs`).

Shapes: B batch, T query length, S key length, D model, N q-heads, K kv-heads, G = N // K,
H head dim, F mlp, V vocab, L layers.

Attention masking has two modes:
  * `lengths` [B]: each row holds one sequence at [0, length) followed by right padding. This is the
    trainer's layout and the one cuDNN flash attention serves directly (causal + padding).
  * a dense boolean mask [B, 1, T, S] built from `attention_mask` (left padding) or `segment_ids`
    (packed sequences); served by the XLA implementation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl_llm import sharding
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.layers import MLP, Linear, RMSNorm, _dtype, rms_norm
from jaxrl_llm.models.linear_attention import GatedDeltaNet
from jaxrl_llm.models.moe import SparseMoeBlock, load_balancing_loss
from jaxrl_llm.models.remat import remat_policy
from jaxrl_llm.models.rope import apply_rope, rope_cos_sin, rope_inv_freq

__all__ = ["MLP", "Linear", "RMSNorm", "rms_norm"]  # re-exported: the sampler and older callers import them from here

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


# ---- positions and masks (RoPE lives in rope.py) -----------------------------------------------------


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its segment; padding (segment 0) gets position 0.

    Args:
      segment_ids: [B, T] int, 0 for padding, equal ids for one sequence (contiguous runs).
    Returns:
      [B, T] int32 positions.
    """
    t = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    start = jnp.where(segment_ids != prev, idx, 0)
    start = jax.lax.cummax(start, axis=1)
    return jnp.where(segment_ids > 0, idx - start, 0)


def segment_mask(q_segment: jax.Array, kv_segment: jax.Array, q_index: jax.Array,
                 kv_index: jax.Array) -> jax.Array:
    """Causal mask within segments: query i sees key j iff same non-zero segment and j <= i.

    Args:
      q_segment: [B, T] int; kv_segment: [B, S] int; q_index: [B, T] int; kv_index: [B, S] int.
    Returns:
      [B, 1, T, S] bool.
    """
    same = (q_segment[:, :, None] == kv_segment[:, None, :]) & (kv_segment[:, None, :] > 0)
    causal = kv_index[:, None, :] <= q_index[:, :, None]
    return (same & causal)[:, None]


def _use_cudnn(impl: str, dtype) -> bool:
    if impl == "xla":
        return False
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if impl == "cudnn":
        if not sixteen_bit:
            raise ValueError("attention_impl='cudnn' needs dtype bfloat16 or float16")
        return True
    return jax.default_backend() == "gpu" and sixteen_bit


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None,
                          lengths: jax.Array | None, impl: str) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H].
      mask: [B, 1, T, S] bool or None (then `lengths` must be given: causal + right padding).
      lengths: [B] int32 valid length of each row (right padding), or None.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    if _use_cudnn(impl, q.dtype):
        # cuDNN flash attention: causal + right padding by lengths, or causal + a segment mask
        # (packed rows), which cuDNN applies as a bias while skipping the upper triangle.
        if lengths is not None:
            lengths = lengths.astype(jnp.int32)
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                                key_value_seq_lengths=lengths, implementation="cudnn")
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="cudnn")
    b, t, n, h = q.shape
    kh = k.shape[2]
    if mask is None:
        idx = jnp.arange(t, dtype=jnp.int32)
        valid = idx[None, :] < lengths[:, None]  # [B, T]
        mask = (valid[:, None, :] & (idx[None, :, None] >= idx[None, None, :]))[:, None]
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (h ** -0.5)
    logits = jnp.where(mask[:, :, None], logits, _MASK_VALUE)  # mask [B, 1, 1, T, S]
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)  # [B, T, K, G, H]
    return out.reshape(b, t, n, h)


# ---- layers ------------------------------------------------------------------------------------


class Attention(nnx.Module):
    """Grouped-query attention's projections; Qwen3.5's (`cfg.is_hybrid`) q_proj also makes a per-head output
    gate ([N, 2H] a token: each head's query, then its gate), applied as `output * sigmoid(gate)`."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        bias = cfg.qkv_bias
        self.gated = cfg.is_hybrid
        q_out = cfg.q_dim * (2 if self.gated else 1)
        self.q_proj = Linear(cfg.hidden_size, q_out, use_bias=bias, cfg=cfg, rngs=rngs, name="q_proj")
        self.k_proj = Linear(cfg.hidden_size, cfg.kv_dim, use_bias=bias, cfg=cfg, rngs=rngs, name="k_proj")
        self.v_proj = Linear(cfg.hidden_size, cfg.kv_dim, use_bias=bias, cfg=cfg, rngs=rngs, name="v_proj")
        self.o_proj = Linear(cfg.q_dim, cfg.hidden_size, use_bias=False, cfg=cfg, rngs=rngs, name="o_proj")
        # Qwen3: RMSNorm over each head's H features (weights shared by the heads), before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg=cfg) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg=cfg) if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.impl = cfg.attention_impl

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H], with RoPE applied to q and k, and the output
        gate [B, T, N H] (None unless gated)."""
        b, t, _ = x.shape
        # Tagged for the remat policies (models/remat.py), as every saveable activation of the layer.
        q = checkpoint_name(self.q_proj(x), "q_proj")
        gate = None
        if self.gated:
            q, gate = jnp.split(q.reshape(b, t, self.num_heads, 2 * self.head_dim), 2, axis=-1)
            gate = gate.reshape(b, t, self.num_heads * self.head_dim)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = checkpoint_name(self.k_proj(x), "k_proj").reshape(b, t, self.num_kv_heads, self.head_dim)
        v = checkpoint_name(self.v_proj(x), "v_proj").reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def output(self, attn: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """attn [B, T, N, H] (and the gate [B, T, N H]) -> [B, T, D]."""
        b, t = attn.shape[:2]
        out = attn.reshape(b, t, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out)


class DecoderLayer(nnx.Module):
    """A token mixer and an MLP. The mixer is attention (`self_attn`) or, in a Qwen3.5 linear layer (`linear`),
    a Gated DeltaNet (`linear_attn`); the MLP is a dense SwiGLU or (`sparse`) routed experts (`moe.py`), with
    Qwen3.5-MoE's gated shared expert beside them."""

    def __init__(self, cfg: DecoderConfig, *, sparse: bool = False, linear: bool = False, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)
        if linear:
            self.linear_attn = GatedDeltaNet(cfg, rngs=rngs)
        else:
            self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)
        self.mlp = SparseMoeBlock(cfg, rngs=rngs) if sparse else MLP(cfg, rngs=rngs)

    def __call__(self, x, cos, sin, *, mask, lengths, valid=None, replay=None, resets=None):
        """x: [B, T, D] -> (x [B, T, D], a sparse layer's (router stats, experts [B, T, k]) or None);
        self-attention over the same T tokens. `valid` [B, T] marks the real tokens (the router stats count
        them; None: all); `replay` [B, T, k] are expert ids to replay (`moe.route`); `resets` [B, T] start a
        packed row (the linear layers' state restarts there)."""
        y = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(y, resets=resets, valid=valid)
        else:
            q, k, v, gate = self.self_attn.qkv(y, cos, sin)
            out = checkpoint_name(dot_product_attention(q, k, v, mask=mask, lengths=lengths,
                                                        impl=self.self_attn.impl), "attention")
            x = x + checkpoint_name(self.self_attn.output(out, gate), "o_proj")
        y = self.post_attention_layernorm(x)
        aux = None
        if isinstance(self.mlp, SparseMoeBlock):
            y, stats, experts = self.mlp(y, valid, replay)
            aux = (stats, experts)
        else:
            y = self.mlp(y)
        x = sharding.constrain(x + y, ("batch", "length", "act_embed"))
        return x, aux


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] bool: the first token of each packed sequence (a linear layer's state restarts there)."""
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=0)
    return (segment_ids != prev) & (segment_ids > 0)


class DecoderModel(nnx.Module):
    """Embedding, L stacked decoder layers and the final norm; returns hidden states.

    The layers are stacked by kind (`cfg.layer_stacks`) and run by `lax.scan` over groups of `cfg.layer_period`
    layers (one layer for a single-kind model, Qwen3.5's three linear layers and an attention layer), so the
    compile time stays flat in depth; a model whose kinds follow no period (a Qwen3-MoE with a few dense layers)
    scans each run of one kind in turn.
    """

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=init,
                                      param_dtype=_dtype(cfg.param_dtype), dtype=_dtype(cfg.dtype),
                                      rngs=rngs)

        def make_layers(count, sparse, linear):
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=count)
            def make(rngs):
                return DecoderLayer(cfg, sparse=sparse, linear=linear, rngs=rngs)

            return make(rngs)

        # One stack per kind of layer (`cfg.layer_stacks`): all layers of a dense model; a Qwen3-MoE's sparse
        # layers, and its dense ones in `dense_layers`; a Qwen3.5's attention layers, and its linear ones in
        # `linear_layers` (a Qwen3.5-MoE's layers are all sparse).
        stacks = cfg.layer_stacks
        self.layers = make_layers(len(stacks["layers"]), cfg.is_moe, False)
        self.dense_layers = make_layers(len(stacks["dense_layers"]), False, False) if "dense_layers" in stacks else None
        self.linear_layers = (make_layers(len(stacks["linear_layers"]), cfg.is_moe, True)
                              if "linear_layers" in stacks else None)
        self.norm = RMSNorm(cfg.hidden_size, cfg=cfg)

    def __call__(self, input_ids, positions=None, attention_mask=None, *, segment_ids=None, lengths=None,
                 with_router_stats: bool = False, routed_experts=None, with_routing: bool = False):
        """Final hidden states [B, T, D] in the compute dtype; then, each when asked for, the MoE
        router's load-balancing sums over every sparse layer ([2, E + 1], `moe.router_stats`) and the
        experts each token was routed to in each sparse layer ([B, T, L_moe, k] int32, the layers in
        the order of `cfg.sparse_layers`).

        `routed_experts` [B, T, L_moe, k] int replays recorded routing (R2/R3, see `moe.route`; -1 rows
        route themselves).

        Args:
          input_ids: [B, T] int.
          positions: [B, T] int, or None to derive them from the mask/segments (or 0..T-1).
          attention_mask: [B, T] HF-style 1/0 validity (left or right padding).
          segment_ids: [B, T] int, packed sequences; 0 is padding. Overrides attention_mask.
          lengths: [B] int, right-padded rows (the trainer's layout; allows cuDNN flash attention).
        """
        cfg = self.cfg
        b, t = input_ids.shape
        mask = valid = resets = None
        if segment_ids is None and attention_mask is not None:
            segment_ids = attention_mask.astype(jnp.int32)
        if segment_ids is not None:
            valid = segment_ids > 0
            resets = segment_starts(segment_ids)
            lengths = None
            idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            mask = segment_mask(segment_ids, segment_ids, idx, idx)
            if positions is None:
                positions = positions_from_segments(segment_ids)
        elif lengths is None:
            lengths = jnp.full((b,), t, jnp.int32)
        else:
            valid = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling))
        x = self.embed_tokens(input_ids)  # [B, T, D]
        x = sharding.constrain(x, ("batch", "length", "act_embed"))

        where = {i: (name, j) for name, ids in cfg.layer_stacks.items() for j, i in enumerate(ids)}
        sparse_at = {i: n for n, i in enumerate(cfg.sparse_layers)}
        stats, routing = None, {}
        replay = None if routed_experts is None else jnp.moveaxis(routed_experts, 2, 0)  # [L_moe, B, T, k]
        for first, groups, period in layer_segments(cfg):
            kinds = [where[first + r][0] for r in range(period)]
            slot = [kinds[:r].count(kind) for r, kind in enumerate(kinds)]  # its place among its kind in a group
            params, graphdefs = {}, {}
            for kind in dict.fromkeys(kinds):  # each stack's layers of this segment, as [groups, per group, ...]
                per, j0 = kinds.count(kind), where[first + kinds.index(kind)][1]
                graphdefs[kind], state = nnx.split(getattr(self, kind))
                params[kind] = jax.tree.map(
                    lambda a, j0=j0, per=per, n=groups: a[j0: j0 + n * per].reshape(n, per, *a.shape[1:]), state)
            layer_ids = [[first + g * period + r for g in range(groups)] for r in range(period)]
            replays = [replay[jnp.asarray([sparse_at[i] for i in ids])] if replay is not None and ids[0] in sparse_at
                       else None for ids in layer_ids]  # [groups, B, T, k] each

            def body(h, xs, kinds=kinds, slot=slot, graphdefs=graphdefs):
                group_params, group_replays = xs
                auxes = []
                for r, kind in enumerate(kinds):
                    layer = nnx.merge(graphdefs[kind], jax.tree.map(lambda a, j=slot[r]: a[j], group_params[kind]))
                    h, aux = layer(h, cos, sin, mask=mask, lengths=lengths, valid=valid, replay=group_replays[r],
                                   resets=resets)
                    auxes.append(aux)
                return h, tuple(auxes)

            if cfg.remat != "none":
                body = jax.checkpoint(body, policy=remat_policy(cfg.remat), prevent_cse=False)
            x, auxes = jax.lax.scan(body, x, (params, replays))
            for ids, aux in zip(layer_ids, auxes):
                if aux is not None:  # a sparse layer: stats [groups, 2, E + 1], experts [groups, B, T, k]
                    run_stats = jnp.sum(aux[0], axis=0)
                    stats = run_stats if stats is None else stats + run_stats
                    routing.update({i: aux[1][g] for g, i in enumerate(ids)})
        x = self.norm(x)
        out = (x,) + ((stats,) if with_router_stats else ())
        if with_routing:
            out += (jnp.stack([routing[i] for i in cfg.sparse_layers], axis=2) if routing else None,)
        return out if len(out) > 1 else x


def layer_segments(cfg: DecoderConfig) -> list[tuple[int, int, int]]:
    """The layer scan's plan: (first layer, groups, period) segments, each scanning `groups` groups of `period`
    consecutive layers. A model whose layer kinds repeat with a period shorter than its depth (one kind: period 1)
    is one segment; otherwise each run of one kind is a segment of period 1."""
    period = cfg.layer_period
    if period < cfg.num_hidden_layers or cfg.num_hidden_layers == 1:
        return [(0, cfg.num_hidden_layers // period, period)]
    segments, first = [], 0
    for _, start, stop in cfg.layer_runs:
        segments.append((first, stop - start, 1))
        first += stop - start
    return segments


class DecoderForCausalLM(nnx.Module):
    """Causal LM: `model(input_ids, positions=None, attention_mask=None)` returns fp32 logits [B, T, V]."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = DecoderModel(cfg, rngs=rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, cfg=cfg, rngs=rngs)

    def lm_head_weight(self) -> jax.Array:
        """[D, V] output projection in the compute dtype (the embedding, transposed, when tied)."""
        if self.lm_head is None:
            w = self.model.embed_tokens.embedding[...].T
        else:
            w = self.lm_head.kernel[...]
        return w.astype(_dtype(self.cfg.dtype))

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> fp32 logits [..., V]."""
        return jnp.dot(hidden, self.lm_head_weight(), preferred_element_type=jnp.float32)

    def hidden_states(self, input_ids, positions=None, attention_mask=None, *, segment_ids=None,
                      lengths=None, with_router_stats: bool = False, routed_experts=None,
                      with_routing: bool = False) -> jax.Array:
        return self.model(input_ids, positions, attention_mask, segment_ids=segment_ids, lengths=lengths,
                          with_router_stats=with_router_stats, routed_experts=routed_experts,
                          with_routing=with_routing)

    def logits_and_router_aux_loss(self, input_ids, positions=None, attention_mask=None, *, segment_ids=None,
                        lengths=None) -> tuple[jax.Array, jax.Array]:
        """(fp32 logits [B, T, V], the MoE load-balancing loss as transformers computes it, unscaled)."""
        h, stats = self.hidden_states(input_ids, positions, attention_mask, segment_ids=segment_ids,
                                      lengths=lengths, with_router_stats=True)
        return self.logits_from_hidden(h), load_balancing_loss(stats)

    def __call__(self, input_ids, positions=None, attention_mask=None, *, segment_ids=None, lengths=None):
        h = self.model(input_ids, positions, attention_mask, segment_ids=segment_ids, lengths=lengths)
        return self.logits_from_hidden(h)


class DecoderCritic(nnx.Module):
    """The backbone with a scalar value head (HF `*ForTokenClassification` of the family, num_labels=1)."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = DecoderModel(cfg, rngs=rngs)
        self.score = Linear(cfg.hidden_size, 1, use_bias=True, cfg=cfg, rngs=rngs)

    def __call__(self, input_ids, positions=None, attention_mask=None, *, segment_ids=None, lengths=None):
        """Values [B, T] in fp32."""
        h = self.model(input_ids, positions, attention_mask, segment_ids=segment_ids, lengths=lengths)
        return self.score(h)[..., 0].astype(jnp.float32)


@functools.cache
def _abstract(cls, cfg: DecoderConfig):
    return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))


def abstract_model(cfg: DecoderConfig, *, critic: bool = False) -> nnx.Module:
    """The model with ShapeDtypeStruct leaves: no memory, for shardings and param counts."""
    return _abstract(DecoderCritic if critic else DecoderForCausalLM, cfg)


# Names from before the other families joined; other modules and users import them.
Qwen2ForCausalLM = DecoderForCausalLM
Qwen2Critic = DecoderCritic
