"""Prefill and the jitted decode loop of the JAX sampler, as pure functions of engine params.

Engine params are an inference layout of the trainer's params: layers *unstacked* (a list, so each
decode step reads every weight once, with no per-layer slicing copies), q/k/v fused into one
[D, Q + 2KV] matmul and gate/up into one [D, 2F] matmul (a decode step is memory-bound: fewer,
larger GEMMs stream the weights closer to the bandwidth limit). KV caches are [B, K, C, H] per layer,
so decode attention is a batched matmul over contiguous [C, H] tiles.

Glossary: R response rows (= prompts x n), P padded prompt length, C cache capacity (P + generated
capacity), D model, F mlp, K kv-heads, G = N // K, H head dim, V vocab.

A row's cache holds its left-padded prompt in slots [P - len, P) and its response from slot P on. P is
a traced value, not a shape: the compiled programs depend only on (R, C), so batches whose longest
prompts differ reuse them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm import sharding
from jaxrl_llm.models.linear_attention import decay_and_beta, gated_rms_norm, split_qkv
from jaxrl_llm.models.moe import moe_mlp
from jaxrl_llm.models.qwen2 import _MASK_VALUE, dot_product_attention, rms_norm, segment_mask
from jaxrl_llm.models.rope import RopeScaling, apply_rope, rope_cos_sin, rope_inv_freq
from jaxrl_llm.rollout.sampling import sample_next, token_logprobs


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static description of one compiled decode program."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    temperature: float
    top_k: int
    top_p: float
    stop_ids: tuple[int, ...]
    pad_id: int
    max_new_tokens: int
    attention: str = "xla"  # decode attention: "xla" (reads every cache slot) or "pallas" (valid slots only)
    moe_top_k: int = 0  # Qwen3-MoE: experts per token in the sparse layers
    norm_topk_prob: bool = False
    num_moe_layers: int = 0  # Qwen3-MoE: how many layers are sparse
    record_routing: bool = False  # return each fed token's experts per sparse layer (routing replay R3)
    rotary_dim: int = 0  # the dims of each head RoPE rotates (0: all; Qwen3.5: a quarter)
    # Qwen3.5: zero-centred norms, the attention output gate, and the Gated DeltaNet layers' shapes
    hybrid: bool = False
    linear_layers: tuple[int, ...] = ()  # which layers are linear attention
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 0
    state_dtype: str = "float32"  # the recurrent state's dtype in the engine's state slots
    state_update: str = "in_place"  # how a decode step writes it back: "in_place" or "scatter" (rollout/jax_engine.py)
    layer_slots: tuple[tuple[str, int], ...] = ()  # a MoE's (stack, index) of each layer: where its experts sit

    def inv_freq(self) -> jax.Array:
        """RoPE inverse frequencies [R/2], from the function the trainer's model uses too."""
        return rope_inv_freq(self.rotary_dim or self.head_dim, self.rope_theta, self.rope_scaling)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim


def engine_layer(layer: dict, dtype) -> dict:
    """One trainer layer (pure dict, unstacked) -> the fused engine layer.

    The family's optional weights carry over when the trainer layer has them: q/k/v biases (Qwen2)
    as `qkv_b`, the per-head q/k norms (Qwen3) as `q_norm` / `k_norm`. A sparse (MoE) layer has the
    router `router_w` [D, E] and the experts `expert_gate_w`, `expert_up_w` [E, D, I], `expert_down_w`
    [E, I, D] in place of the dense MLP, and (Qwen3.5-MoE) the shared expert `shared_gate_up_w`, `shared_down_w`
    and its gate `shared_gate_w` [D, 1]. A Qwen3.5 linear-attention layer has, instead of attention, one fused
    input projection `lin_in_w` [D, E + Hv Dv + 2 Hv] (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), the conv
    `conv_w` [K, E], `A_log`, `dt_bias`, the gated norm `lin_norm` [Dv] and `lin_out_w` [Hv Dv, D].
    """
    m = layer["mlp"]
    cast = lambda x: x.astype(dtype)
    out = {"ln1": cast(layer["input_layernorm"]["weight"]), "ln2": cast(layer["post_attention_layernorm"]["weight"])}
    if "linear_attn" in layer:
        a = layer["linear_attn"]
        out["lin_in_w"] = cast(jnp.concatenate([a[k]["kernel"] for k in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                         "in_proj_a")], -1))
        out["conv_w"] = cast(a["conv1d"]["kernel"][:, 0, :])
        out["A_log"], out["dt_bias"] = cast(a["A_log"]), cast(a["dt_bias"])
        out["lin_norm"], out["lin_out_w"] = cast(a["norm"]["weight"]), cast(a["out_proj"]["kernel"])
    else:
        a = layer["self_attn"]
        out["qkv_w"] = cast(jnp.concatenate([a["q_proj"]["kernel"], a["k_proj"]["kernel"], a["v_proj"]["kernel"]],
                                            -1))
        out["o_w"] = cast(a["o_proj"]["kernel"])
        if "bias" in a["q_proj"]:
            out["qkv_b"] = cast(jnp.concatenate([a["q_proj"]["bias"], a["k_proj"]["bias"], a["v_proj"]["bias"]], -1))
        if "q_norm" in a:
            out["q_norm"], out["k_norm"] = cast(a["q_norm"]["weight"]), cast(a["k_norm"]["weight"])
    if "gate" in m:  # a sparse layer (its experts may be read in place from the stack instead: `layer_params`)
        out["router_w"] = cast(m["gate"]["kernel"])
        if "experts" in m:
            out.update({f"expert_{k}_w": cast(m["experts"][f"{k}_proj"]) for k in ("gate", "up", "down")})
        if "shared_expert" in m:
            sh = m["shared_expert"]
            out["shared_gate_up_w"] = cast(jnp.concatenate([sh["gate_proj"]["kernel"], sh["up_proj"]["kernel"]], -1))
            out["shared_down_w"] = cast(sh["down_proj"]["kernel"])
            out["shared_gate_w"] = cast(m["shared_expert_gate"]["kernel"])
    else:
        out["gate_up_w"] = cast(jnp.concatenate([m["gate_proj"]["kernel"], m["up_proj"]["kernel"]], -1))
        out["down_w"] = cast(m["down_proj"]["kernel"])
    return out


ENGINE_LAYER_AXES = {
    "ln1": ("norm",), "qkv_w": ("embed", "q_heads"), "qkv_b": ("q_heads",), "o_w": ("q_heads", "embed"),
    "ln2": ("norm",), "gate_up_w": ("embed", "mlp"), "down_w": ("mlp", "embed"), "q_norm": ("norm",),
    "k_norm": ("norm",), "router_w": ("embed", None), "expert_gate_w": ("expert", "embed", "mlp"),
    "expert_up_w": ("expert", "embed", "mlp"), "expert_down_w": ("expert", "mlp", "embed"),
    "shared_gate_up_w": ("embed", "mlp"), "shared_down_w": ("mlp", "embed"), "shared_gate_w": ("embed", None),
    # the Gated DeltaNet: whole on every device of a shard (its fused columns are not head-aligned for `tensor`)
    "lin_in_w": ("embed", None), "conv_w": (None, None), "A_log": (None,), "dt_bias": (None,), "lin_norm": ("norm",),
    "lin_out_w": (None, "embed"),
}


def _layer(lp: dict, x, cos, sin, attend, spec: DecodeSpec, recur=None):
    """The decoder layer on fused weights (any family: the optional weights in `lp` switch its parts).
    x [B, T, D] -> (x, aux of the mixer, a sparse layer's experts [B, T, k] int32 or None).

    The token mixer of an attention layer is `attend(q [B, T, N, H], k, v [B, T, K, H]) -> (out, aux)`; of a
    Qwen3.5 linear layer `recur(mixed [B, T, E], g, beta [B, T, Hv], conv_w [K, E]) -> (o [B, T, Hv, Dv] fp32,
    aux)`, which runs the conv and the gated delta rule against the engine's state slots."""
    b, t, _ = x.shape
    n, k, h = spec.num_heads, spec.num_kv_heads, spec.head_dim
    y = rms_norm(x, lp["ln1"], spec.rms_norm_eps, offset=spec.hybrid)
    if "lin_in_w" in lp:
        e, hv, dv = spec.conv_dim, spec.linear_value_heads, spec.linear_value_dim
        proj = jnp.dot(y, lp["lin_in_w"])  # [B, T, E + Hv Dv + 2 Hv]
        mixed, z = proj[..., :e], proj[..., e: e + hv * dv].reshape(b, t, hv, dv)
        g, beta = decay_and_beta(proj[..., e + hv * dv + hv:], proj[..., e + hv * dv: e + hv * dv + hv],
                                 lp["A_log"], lp["dt_bias"])
        o, aux = recur(mixed, g, beta, lp["conv_w"])
        o = gated_rms_norm(o.astype(x.dtype), z, lp["lin_norm"], spec.rms_norm_eps)
        x = x + jnp.dot(o.reshape(b, t, hv * dv), lp["lin_out_w"])
    else:
        qkv = jnp.dot(y, lp["qkv_w"])  # [B, T, (N (x2 with the gate) + 2K) H]
        if "qkv_b" in lp:
            qkv = qkv + lp["qkv_b"]
        qw = n * h * (2 if spec.hybrid else 1)
        q, gate = qkv[..., :qw], None
        if spec.hybrid:  # each head's query, then its output gate
            q, gate = jnp.split(q.reshape(b, t, n, 2 * h), 2, axis=-1)
            gate = gate.reshape(b, t, n * h)
        q = q.reshape(b, t, n, h)
        kk = qkv[..., qw: qw + k * h].reshape(b, t, k, h)
        v = qkv[..., qw + k * h:].reshape(b, t, k, h)
        if "q_norm" in lp:
            q = rms_norm(q, lp["q_norm"], spec.rms_norm_eps, offset=spec.hybrid)
            kk = rms_norm(kk, lp["k_norm"], spec.rms_norm_eps, offset=spec.hybrid)
        out, aux = attend(apply_rope(q, cos, sin), apply_rope(kk, cos, sin), v)
        out = out.reshape(b, t, n * h)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        x = x + jnp.dot(out, lp["o_w"])
    y = rms_norm(x, lp["ln2"], spec.rms_norm_eps, offset=spec.hybrid)
    if "router_w" in lp:  # a sparse layer: grouped matmuls over the routed experts (models/moe.py)
        out, _, experts = moe_mlp(y, None, lp["router_w"], lp["expert_gate_w"], lp["expert_up_w"],
                                  lp["expert_down_w"], top_k=spec.moe_top_k, norm_topk_prob=spec.norm_topk_prob,
                                  layer=lp.get("expert_layer"))
        if "shared_gate_up_w" in lp:
            sg, su = jnp.split(jnp.dot(y, lp["shared_gate_up_w"]), 2, axis=-1)
            out = out + jax.nn.sigmoid(jnp.dot(y, lp["shared_gate_w"])) * jnp.dot(jax.nn.silu(sg) * su,
                                                                                  lp["shared_down_w"])
        return x + out, aux, experts
    gate, up = jnp.split(jnp.dot(y, lp["gate_up_w"]), 2, axis=-1)  # [B, T, F] each
    x = x + jnp.dot(jax.nn.silu(gate) * up, lp["down_w"])
    return x, aux, None


def layer_params(eparams: dict, i: int, spec: DecodeSpec) -> dict:
    """Layer i's engine weights. A sparse layer whose experts the engine reads in place (`eparams["experts"]`, see
    rollout/engine_weights.py) gets its stack's [L, E, ...] arrays and its index in them (a static int)."""
    lp = eparams["layers"][i]
    if "experts" not in eparams or "router_w" not in lp or "expert_gate_w" in lp:
        return lp
    stack, j = spec.layer_slots[i]
    ex = eparams["experts"][stack]
    return {**lp, "expert_gate_w": ex["gate_proj"], "expert_up_w": ex["up_proj"], "expert_down_w": ex["down_proj"],
            "expert_layer": j}


def split_mixed(mixed: jax.Array, spec: DecodeSpec):
    """The conv's output [..., E] -> q, k [..., Hk, Dk] (normalised, q scaled) and v [..., Hv, Dv]."""
    return split_qkv(mixed, spec.linear_key_heads, spec.linear_value_heads, spec.linear_key_dim,
                     spec.linear_value_dim)


def stack_routing(experts: list) -> jax.Array | None:
    """The sparse layers' experts [B, T, k] each (None entries are dense layers) -> [B, T, L_moe, k]."""
    experts = [e for e in experts if e is not None]
    return jnp.stack(experts, axis=2) if experts else None


def _final_logits(eparams, h, spec: DecodeSpec):
    """h [R, D] -> fp32 logits [R, V]."""
    h = rms_norm(h, eparams["norm"], spec.rms_norm_eps, offset=spec.hybrid)
    return jnp.dot(h, eparams["head"], preferred_element_type=jnp.float32)


def alloc_caches(rows: int, capacity: int, spec: DecodeSpec, dtype):
    """Zeroed KV caches: list of (k, v) [R, K, C, H]."""
    shape = (rows, spec.num_kv_heads, capacity, spec.head_dim)
    z = lambda: sharding.constrain(jnp.zeros(shape, dtype), ("batch", "act_kv_heads", None, None))
    return [(z(), z()) for _ in range(spec.num_layers)]


def prefill_into(eparams, caches, ids, mask, row0, prompt_slots, *, spec: DecodeSpec, n: int):
    """Runs a sub-batch of prompts and writes its K/V into the shared caches.

    Prompts of similar length are prefilled together at their own padded length Ps, then written
    (repeated n times, one copy per response row) at rows [row0, row0 + B n) and slots
    [prompt_slots - Ps, prompt_slots): the left-padded prompt region every row shares.

    Args:
      caches: list of (k, v) [R, K, C, H] (donated by the caller's jit).
      ids: [B, Ps] left-padded prompt ids; mask: [B, Ps] 1 for real tokens.
      row0, prompt_slots: int32 scalars (P = prompt_slots >= Ps).
    Returns:
      caches, logits of each prompt's last token [B, V] fp32, and (`spec.record_routing`) the prompt
      tokens' experts [B, Ps, L_moe, k] int32 (else None).
    """
    b, ps = ids.shape
    positions = jnp.clip(jnp.cumsum(mask, axis=1) - 1, 0)
    cos, sin = rope_cos_sin(positions, spec.inv_freq())
    idx = jnp.broadcast_to(jnp.arange(ps, dtype=jnp.int32), (b, ps))
    attn_mask = segment_mask(mask, mask, idx, idx)
    x = jnp.take(eparams["embed"], ids, axis=0)
    at = (row0, 0, prompt_slots - ps, 0)
    new, experts = [], []
    for i, (kc, vc) in enumerate(caches):
        lp = layer_params(eparams, i, spec)

        def attend(q, k, v, kc=kc, vc=vc):
            out = dot_product_attention(q, k, v, mask=attn_mask, lengths=None, impl="xla")
            k = jnp.repeat(k.transpose(0, 2, 1, 3), n, axis=0).astype(kc.dtype)  # [B n, K, Ps, H]
            v = jnp.repeat(v.transpose(0, 2, 1, 3), n, axis=0).astype(vc.dtype)
            return out, (jax.lax.dynamic_update_slice(kc, k, at), jax.lax.dynamic_update_slice(vc, v, at))

        x, kv, ex = _layer(lp, x, cos, sin, attend, spec)
        new.append(kv)
        experts.append(ex)
    routing = stack_routing(experts) if spec.record_routing else None
    return new, _final_logits(eparams, x[:, -1], spec), routing


def _decode_attention(q, kc, vc, valid):
    """One query token against the cache.

    Args:
      q: [R, 1, N, H]; kc, vc: [R, K, C, H]; valid: [R, C] bool.
    Returns:
      [R, 1, N, H].
    """
    r, _, n, h = q.shape
    k = kc.shape[1]
    qg = q.reshape(r, k, n // k, h)  # [R, K, G, H]
    scores = jnp.einsum("rkgh,rkch->rkgc", qg, kc.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(valid[:, None, None, :], scores * (h ** -0.5), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("rkgc,rkch->rkgh", probs, vc.astype(q.dtype))
    return out.reshape(r, 1, n, h)


def _pallas_decode_attention(q, kc, vc, starts, ends):
    """The ragged kernel (kernels/decode_attention.py): row r reads only slots [starts[r], ends[r]).

    Under a mesh it runs per shard (rows over the data axes, kv heads over "tensor", as the caches
    are laid out), since a pallas_call has no partitioning rule of its own.

    Args:
      q: [R, 1, N, H]; kc, vc: [R, K, C, H]; starts, ends: [R] int32.
    Returns:
      [R, 1, N, H].
    """
    from kernels.decode_attention import decode_attention  # the repo's kernels/ package

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return decode_attention(q, kc, vc, starts, ends)
    cache_spec = sharding.logical_to_spec(("batch", "act_kv_heads", None, None), kc.shape, mesh)
    q_spec = P(cache_spec[0], None, cache_spec[1], None)  # N = K G: splitting K splits N alike
    row_spec = P(cache_spec[0])
    return jax.shard_map(decode_attention, mesh=mesh, in_specs=(q_spec, cache_spec, cache_spec, row_spec, row_spec),
                         out_specs=q_spec, check_vma=False)(q, kc, vc, starts, ends)


def _is_stop(tokens, stop_ids):
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[:, None] == jnp.asarray(stop_ids, jnp.int32)[None, :], axis=-1)


def _sample(logits, row_keys, t, spec: DecodeSpec):
    """One token per row; row r draws from fold_in(row_keys[r], t), so a response's samples depend on
    (seed, response index, step) alone, not on which other rows share its batch."""
    keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, t)
    draw = lambda k, lg: sample_next(lg[None], k, temperature=spec.temperature, top_k=spec.top_k,
                                     top_p=spec.top_p)[0]
    return jax.vmap(draw)(keys, logits)


def first_token(logits, key, prompt_lens, row_max, row_ids, *, spec: DecodeSpec, n: int) -> dict[str, Any]:
    """Samples token 0 of every response from the prompts' last logits [B, V]; builds the loop state.

    `row_max` [R] caps each response's length (<= spec.max_new_tokens); `row_ids` [R] are the
    responses' indices in the whole request (they seed each row's random stream)."""
    logits = jnp.repeat(logits, n, axis=0)  # [R, V]
    r = logits.shape[0]
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, row_ids)
    tok = _sample(logits, row_keys, 0, spec)
    logp = token_logprobs(logits, tok, temperature=spec.temperature)
    tokens = jnp.full((r, spec.max_new_tokens), spec.pad_id, jnp.int32).at[:, 0].set(tok)
    logps = jnp.zeros((r, spec.max_new_tokens), jnp.float32).at[:, 0].set(logp)
    done = _is_stop(tok, spec.stop_ids) | (row_max <= 1)
    state = dict(tokens=tokens, logps=logps, done=done, lengths=jnp.ones((r,), jnp.int32),
                 t=jnp.asarray(1, jnp.int32), row_keys=row_keys, prompt_lens=jnp.repeat(prompt_lens, n),
                 row_max=row_max)
    if spec.record_routing:  # the experts of response token t, recorded by the step that feeds it
        state["routing"] = jnp.full((r, spec.max_new_tokens, spec.num_moe_layers, spec.moe_top_k), -1, jnp.int32)
    return state


def decode_segment(eparams, state, caches, prompt_start, prompt_slots, t_end, *, spec: DecodeSpec):
    """Decodes steps t in [state.t, t_end) or until every row has stopped.

    Step t feeds token t-1 (written to cache slot P + t - 1) and samples token t.

    Args:
      state: the loop state of `first_token` (tokens [R, T_max], logps, done [R], lengths, t, key).
      caches: list of (k, v) [R, K, C, H]; t_end <= C - P + 1.
      prompt_start: [R] int32, each row's first prompt slot (P - prompt length); prompt_slots: P.
    Returns:
      (state, caches) after the segment.
    """
    capacity = caches[0][0].shape[2]
    slot_ids = jnp.arange(capacity, dtype=jnp.int32)[None, :]

    def cond(carry):
        st, _ = carry
        return (st["t"] < t_end) & ~jnp.all(st["done"])

    def body(carry):
        st, cs = carry
        t = st["t"]
        tok_in = jax.lax.dynamic_index_in_dim(st["tokens"], t - 1, axis=1, keepdims=False)  # [R]
        positions = (st["prompt_lens"] + t - 1)[:, None]  # [R, 1]
        cos, sin = rope_cos_sin(positions, spec.inv_freq())
        slot = prompt_slots + t - 1
        valid = (slot_ids >= prompt_start[:, None]) & (slot_ids <= slot)  # the prompt, then slots P .. P + t - 1
        # The kernel reads [start, end) alone; finished rows read nothing (their outputs are discarded).
        ends = jnp.where(st["done"], prompt_start, slot + 1)  # [R]
        x = jnp.take(eparams["embed"], tok_in[:, None], axis=0)  # [R, 1, D]
        new_cs, experts = [], []
        for i, (kc, vc) in enumerate(cs):
            lp = layer_params(eparams, i, spec)

            def attend(q, k, v, kc=kc, vc=vc):
                at = (0, 0, slot, 0)
                kc = jax.lax.dynamic_update_slice(kc, k.transpose(0, 2, 1, 3).astype(kc.dtype), at)
                vc = jax.lax.dynamic_update_slice(vc, v.transpose(0, 2, 1, 3).astype(vc.dtype), at)
                if spec.attention == "pallas":
                    return _pallas_decode_attention(q, kc, vc, prompt_start, ends), (kc, vc)
                return _decode_attention(q, kc, vc, valid), (kc, vc)

            x, kv, ex = _layer(lp, x, cos, sin, attend, spec)
            new_cs.append(kv)
            experts.append(ex)
        logits = _final_logits(eparams, x[:, 0], spec)  # [R, V]
        tok = _sample(logits, st["row_keys"], t, spec)
        logp = token_logprobs(logits, tok, temperature=spec.temperature)
        was_done = st["done"]
        tok = jnp.where(was_done, spec.pad_id, tok)
        logp = jnp.where(was_done, 0.0, logp)
        done = was_done | _is_stop(tok, spec.stop_ids) | (t + 1 >= st["row_max"])
        st = dict(st, t=t + 1, done=done, lengths=st["lengths"] + (~was_done).astype(jnp.int32),
                  tokens=jax.lax.dynamic_update_index_in_dim(st["tokens"], tok, t, axis=1),
                  logps=jax.lax.dynamic_update_index_in_dim(st["logps"], logp, t, axis=1))
        if spec.record_routing:  # token t - 1 was fed: its experts [R, L_moe, k]
            fed = jnp.where(was_done[:, None, None], -1, stack_routing(experts)[:, 0])
            st["routing"] = jax.lax.dynamic_update_index_in_dim(st["routing"], fed, t - 1, axis=1)
        return st, new_cs

    return jax.lax.while_loop(cond, body, (state, list(caches)))


def grow_caches(caches, new_capacity: int):
    """Pads every cache along the slot axis to `new_capacity` (one copy, amortised over a segment)."""
    out = []
    for kc, vc in caches:
        pad = ((0, 0), (0, 0), (0, new_capacity - kc.shape[2]), (0, 0))
        out.append((jnp.pad(kc, pad), jnp.pad(vc, pad)))
    return out


def compact(state, caches, prompt_start, sel, filler, capacity: int, shards: int = 1):
    """Keeps rows `sel` of the running batch and grows the caches to `capacity`.

    With `shards` > 1 the batch axis is split into that many equal blocks (its data-parallel
    shards) and `sel` [shards, R' / shards] indexes rows *within* each block, so every device keeps
    rows it already holds and no cache crosses devices. Rows where `filler` [R'] is True pad the
    blocks to equal size; they are marked done.
    """
    rows = state["done"].shape[0]
    sel = sel.reshape(shards, -1)

    def take(x):
        blocks = x.reshape(shards, rows // shards, *x.shape[1:])
        picked = jax.vmap(lambda b, i: jnp.take(b, i, axis=0))(blocks, sel)
        return picked.reshape(-1, *x.shape[1:])

    state = {k: (take(v) if v.ndim and v.shape[0] == rows else v) for k, v in state.items()}
    state["done"] = state["done"] | filler
    caches = grow_caches([(take(k), take(v)) for k, v in caches], capacity)
    caches = [(sharding.constrain(k, ("batch", "act_kv_heads", None, None)),
               sharding.constrain(v, ("batch", "act_kv_heads", None, None))) for k, v in caches]
    return state, caches, take(prompt_start)
