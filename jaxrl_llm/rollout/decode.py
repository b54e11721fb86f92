"""Prefill and the jitted decode loop of the JAX sampler, as pure functions of engine params.

Engine params hold the layers *unstacked* (a list, one dict per layer) in the engine dtype, so each
decode step reads every weight exactly once with no per-layer slicing copies. KV caches are
[B, K, S, H] per layer: the decode attention is then a batched matmul over contiguous [S, H] tiles.

Glossary: R response rows (= prompts x n), P padded prompt length, C cache capacity (P + generated
capacity), K kv-heads, G = N // K, H head dim, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm import sharding
from jaxrl_llm.models.qwen2 import (
    _MASK_VALUE,
    dot_product_attention,
    rope_cos_sin,
    segment_mask,
)
from jaxrl_llm.rollout.sampling import sample_next, token_logprobs


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static description of one compiled decode program."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    temperature: float
    top_k: int
    top_p: float
    stop_ids: tuple[int, ...]
    pad_id: int
    max_new_tokens: int


def _embed(eparams, ids):
    return jnp.take(eparams["embed"], ids, axis=0)


def _final_logits(gd, eparams, h):
    """h [R, D] -> fp32 logits [R, V]."""
    h = nnx.merge(gd.norm, eparams["norm"])(h)
    return jnp.dot(h, eparams["head"], preferred_element_type=jnp.float32)


def prefill(gd, eparams, ids, mask, *, spec: DecodeSpec, capacity: int):
    """Runs the prompts and fills the first P slots of fresh KV caches.

    Args:
      ids: [B, P] left-padded prompt ids; mask: [B, P] 1 for real tokens.
      capacity: C, total cache slots (P prompt slots + generation slots).
    Returns:
      caches: list of (k, v) [B, K, C, H]; logits of the last prompt token [B, V] fp32.
    """
    b, p = ids.shape
    positions = jnp.clip(jnp.cumsum(mask, axis=1) - 1, 0)
    cos, sin = rope_cos_sin(positions, spec.head_dim, spec.rope_theta)
    idx = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    attn_mask = segment_mask(mask, mask, idx, idx)
    x = _embed(eparams, ids)
    caches = []
    for lp in eparams["layers"]:
        layer = nnx.merge(gd.layer, lp)

        def attend(q, k, v):
            out = dot_product_attention(q, k, v, mask=attn_mask, lengths=None, impl="xla")
            pad = ((0, 0), (0, 0), (0, capacity - p), (0, 0))
            kc = jnp.pad(k.transpose(0, 2, 1, 3), pad)  # [B, K, C, H]
            vc = jnp.pad(v.transpose(0, 2, 1, 3), pad)
            kc = sharding.constrain(kc, ("batch", "act_kv_heads", None, None))
            vc = sharding.constrain(vc, ("batch", "act_kv_heads", None, None))
            return out, (kc, vc)

        x, kv = layer.forward(x, cos, sin, attend)
        caches.append(kv)
    return caches, _final_logits(gd, eparams, x[:, -1])


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


def _is_stop(tokens, stop_ids):
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[:, None] == jnp.asarray(stop_ids, jnp.int32)[None, :], axis=-1)


def first_token(logits, key, prompt_lens, row_max, *, spec: DecodeSpec, n: int) -> dict[str, Any]:
    """Samples token 0 of every response from the (repeated) prefill logits; builds the loop state.

    `row_max` [R] caps each response's length (<= spec.max_new_tokens)."""
    logits = jnp.repeat(logits, n, axis=0)  # [R, V]
    r = logits.shape[0]
    tok = sample_next(logits, jax.random.fold_in(key, 0), temperature=spec.temperature,
                      top_k=spec.top_k, top_p=spec.top_p)
    logp = token_logprobs(logits, tok, temperature=spec.temperature)
    tokens = jnp.full((r, spec.max_new_tokens), spec.pad_id, jnp.int32).at[:, 0].set(tok)
    logps = jnp.zeros((r, spec.max_new_tokens), jnp.float32).at[:, 0].set(logp)
    done = _is_stop(tok, spec.stop_ids) | (row_max <= 1)
    return dict(tokens=tokens, logps=logps, done=done, lengths=jnp.ones((r,), jnp.int32),
                t=jnp.asarray(1, jnp.int32), key=key, prompt_lens=jnp.repeat(prompt_lens, n), row_max=row_max)


def decode_segment(gd, eparams, state, caches, prompt_mask, t_end, *, spec: DecodeSpec):
    """Decodes steps t in [state.t, t_end) or until every row has stopped.

    Step t feeds token t-1 (written to cache slot P + t - 1) and samples token t.

    Args:
      state: the loop state of `first_token` (tokens [R, T_max], logps, done [R], lengths, t, key).
      caches: list of (k, v) [R, K, C, H]; prompt_mask: [R, P] bool.
    Returns:
      (state, caches) after the segment.
    """
    p = prompt_mask.shape[1]
    capacity = caches[0][0].shape[2]

    def cond(carry):
        st, _ = carry
        return (st["t"] < t_end) & ~jnp.all(st["done"])

    def body(carry):
        st, cs = carry
        t = st["t"]
        tok_in = jax.lax.dynamic_index_in_dim(st["tokens"], t - 1, axis=1, keepdims=False)  # [R]
        positions = (st["prompt_lens"] + t - 1)[:, None]  # [R, 1]
        cos, sin = rope_cos_sin(positions, spec.head_dim, spec.rope_theta)
        gen_valid = jnp.arange(capacity - p) < t  # slots P .. P + t - 1
        valid = jnp.concatenate([prompt_mask, jnp.broadcast_to(gen_valid, (prompt_mask.shape[0],
                                                                           capacity - p))], axis=1)
        slot = p + t - 1
        x = _embed(eparams, tok_in[:, None])  # [R, 1, D]
        new_cs = []
        for lp, (kc, vc) in zip(eparams["layers"], cs):
            layer = nnx.merge(gd.layer, lp)

            def attend(q, k, v, kc=kc, vc=vc):
                kc = jax.lax.dynamic_update_slice(kc, k.transpose(0, 2, 1, 3).astype(kc.dtype), (0, 0, slot, 0))
                vc = jax.lax.dynamic_update_slice(vc, v.transpose(0, 2, 1, 3).astype(vc.dtype), (0, 0, slot, 0))
                return _decode_attention(q, kc, vc, valid), (kc, vc)

            x, kv = layer.forward(x, cos, sin, attend)
            new_cs.append(kv)
        logits = _final_logits(gd, eparams, x[:, 0])  # [R, V]
        tok = sample_next(logits, jax.random.fold_in(st["key"], t), temperature=spec.temperature,
                          top_k=spec.top_k, top_p=spec.top_p)
        logp = token_logprobs(logits, tok, temperature=spec.temperature)
        was_done = st["done"]
        tok = jnp.where(was_done, spec.pad_id, tok)
        logp = jnp.where(was_done, 0.0, logp)
        done = was_done | _is_stop(tok, spec.stop_ids) | (t + 1 >= st["row_max"])
        st = dict(st, t=t + 1, done=done, lengths=st["lengths"] + (~was_done).astype(jnp.int32),
                  tokens=jax.lax.dynamic_update_index_in_dim(st["tokens"], tok, t, axis=1),
                  logps=jax.lax.dynamic_update_index_in_dim(st["logps"], logp, t, axis=1))
        return st, new_cs

    return jax.lax.while_loop(cond, body, (state, list(caches)))


def grow_caches(caches, new_capacity: int):
    """Pads every cache along the slot axis to `new_capacity` (one copy, amortised over a segment)."""
    out = []
    for kc, vc in caches:
        pad = ((0, 0), (0, 0), (0, new_capacity - kc.shape[2]), (0, 0))
        out.append((jnp.pad(kc, pad), jnp.pad(vc, pad)))
    return out
