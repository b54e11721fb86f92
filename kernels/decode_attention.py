"""Ragged decode attention: one query token per row, reading only the row's valid KV slots.

The sampler's KV caches are [R, K, C, H] per layer (jaxrl_llm/rollout/decode.py). A row's valid slots
form one contiguous range [start_r, end_r): its left-padded prompt starts at start_r = P - prompt length,
its response follows from slot P on, and decode step t attends to [start_r, P + t). XLA's attention
reads all C slots of every row; this kernel reads only the KV blocks that overlap the range and masks
the slots of the first and last block that fall outside it. A row with end <= start reads nothing and
returns zeros (the sampler passes that for finished rows).

Pallas with the Triton lowering on GPU; interpret mode elsewhere (tests). Grid (row, kv head, split):
a program reads its row's bounds from two [R] int32 inputs (the Triton backend has no scalar
prefetch), loads the G query heads of its kv head (padded to 16 rows, the smallest Triton dot), and
loops over its share of the row's KV blocks with an online softmax in fp32. With `num_splits` > 1
(small batches, so that every SM has work) each split writes a partial output and its log-sum-exp,
and a few jnp ops combine them. The caches are read in place: no transpose or copy.

Glossary: R rows, N q heads, K kv heads, G = N // K, C cache slots, H head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# The sampler's mask value (jaxrl_llm.models.qwen2._MASK_VALUE), so the reference matches it exactly.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Running max before any valid slot: above MASK_VALUE, so a masked slot always weighs exp(-huge) = 0,
# and finite, so a block with no valid slot cannot make exp(m_old - m_new) a NaN.
_M_INIT = -1e30
MIN_GROUP_ROWS = 16  # Triton's dot needs M >= 16: a kv head's G query heads are padded to this


def decode_attention_reference(q, k_cache, v_cache, starts, ends):
    """The sampler's decode attention in jnp (what `decode._decode_attention` computes), on row bounds.

    Args:
      q: [R, 1, N, H] the step's queries (after RoPE).
      k_cache, v_cache: [R, K, C, H].
      starts, ends: [R] int32; row r attends to slots [starts[r], ends[r]).
    Returns:
      [R, 1, N, H] in q's dtype; zeros for a row with ends <= starts.
    """
    r, _, n, h = q.shape
    k = k_cache.shape[1]
    slots = jnp.arange(k_cache.shape[2], dtype=jnp.int32)[None, :]
    valid = (slots >= starts[:, None]) & (slots < ends[:, None])  # [R, C]
    qg = q.reshape(r, k, n // k, h)  # [R, K, G, H]
    scores = jnp.einsum("rkgh,rkch->rkgc", qg, k_cache.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(valid[:, None, None, :], scores * (h ** -0.5), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("rkgc,rkch->rkgh", probs, v_cache.astype(q.dtype))
    out = jnp.where((ends > starts)[:, None, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(r, 1, n, h)


def _kernel(starts_ref, ends_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block_kv: int, num_splits: int,
            scale: float, precision):
    """One (row, kv head, split). q_ref [Gp, H]; k_ref, v_ref [C, H]; starts_ref, ends_ref [];
    o_ref [Gp, H]; lse_ref [Gp]."""
    capacity = k_ref.shape[0]
    split = pl.program_id(2)
    start = jnp.maximum(starts_ref[()], 0)
    end = jnp.minimum(ends_ref[()], capacity)
    first = lax.div(start, block_kv)  # the block holding the first valid slot
    last = lax.div(end + (block_kv - 1), block_kv)  # one past the block holding the last one
    per_split = lax.div(jnp.maximum(last - first, 0) + (num_splits - 1), num_splits)
    lo = first + split * per_split
    hi = jnp.minimum(lo + per_split, last)

    q = q_ref[...]
    gp, h = q.shape
    offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def body(i, carry):
        acc, m, denom = carry  # [Gp, H], [Gp] running max, [Gp] running sum of exp; fp32
        s0 = pl.multiple_of(i * block_kv, block_kv)
        k = k_ref[pl.ds(s0, block_kv), :]  # [bk, H]
        v = v_ref[pl.ds(s0, block_kv), :]
        s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [Gp, bk] fp32
        slot = s0 + offsets
        valid = (slot >= start) & (slot < end)
        s = jnp.where(valid[None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        denom = denom * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + jnp.dot(p.astype(q.dtype), v.astype(q.dtype), precision=precision,
                                                  preferred_element_type=jnp.float32)
        return acc, m_new, denom

    init = (jnp.zeros((gp, h), jnp.float32), jnp.full((gp,), _M_INIT, jnp.float32), jnp.zeros((gp,), jnp.float32))
    acc, m, denom = lax.fori_loop(lo, hi, body, init)
    nonempty = denom > 0
    denom = jnp.where(nonempty, denom, 1.0)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m + jnp.log(denom), _M_INIT)


def _block_size(capacity: int, block_kv: int) -> int:
    """The largest power of two <= block_kv that divides the cache's slot count."""
    b = 1
    while b * 2 <= block_kv and capacity % (b * 2) == 0:
        b *= 2
    return b


def _default_splits(programs: int, blocks: int) -> int:
    """Splits of each row's blocks so that about 4 programs per SM run (1 at large batches)."""
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    s = 1
    while s < 8 and programs * s < 4 * sms and 2 * s <= blocks:
        s *= 2
    return s


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("block_kv", "num_splits", "num_warps", "num_stages", "interpret"))
def decode_attention(q, k_cache, v_cache, starts, ends, *, block_kv: int = 64, num_splits: int | None = None,
                     num_warps: int = 4, num_stages: int = 2, interpret: bool | None = None):
    """Decode attention of one query token per row over the row's valid slots [starts, ends) only.

    Same semantics as `decode_attention_reference` (the sampler's attention).

    Args:
      q: [R, 1, N, H] the step's queries (after RoPE), bf16 or fp32.
      k_cache, v_cache: [R, K, C, H], read in place (same dtype as q).
      starts, ends: [R] int32; row r attends to slots [starts[r], ends[r]) (clipped to [0, C)).
      block_kv: KV slots a loop step reads; the largest power of two <= it that divides C is used.
      num_splits: programs a (row, kv head) is split over (None: 1 on large batches, more on small).
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel in Pallas' interpreter (None: when the default backend is not a GPU).
    Returns:
      [R, 1, N, H] in q's dtype.
    """
    r, _, n, h = q.shape
    _, kh, capacity, _ = k_cache.shape
    g = n // kh
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    bk = _block_size(capacity, block_kv)
    if not interpret and (bk < 16 or h & (h - 1) or h < 16):
        raise ValueError(f"the Triton kernel needs the cache slots ({capacity}) divisible by a power of two "
                         f">= 16 and a power-of-two head dim >= 16 (got {h})")
    splits = num_splits or (1 if interpret else _default_splits(r * kh, capacity // bk))
    gp = max(MIN_GROUP_ROWS, _next_pow2(g))
    qg = q.reshape(r, kh, g, h)  # [R, K, G, H]
    if gp > g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [R, K, Gp, H]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, block_kv=bk, num_splits=splits, scale=h ** -0.5, precision=precision)
    row = pl.BlockSpec(block_shape=(None,), index_map=lambda i, j, s: (i,))
    cache = pl.BlockSpec(block_shape=(None, None, capacity, h), index_map=lambda i, j, s: (i, j, 0, 0))
    o, lse = pl.pallas_call(
        kernel,
        grid=(r, kh, splits),
        in_specs=[row, row, pl.BlockSpec(block_shape=(None, None, gp, h), index_map=lambda i, j, s: (i, j, 0, 0)),
                  cache, cache],
        out_specs=[pl.BlockSpec(block_shape=(None, None, None, gp, h), index_map=lambda i, j, s: (i, j, s, 0, 0)),
                   pl.BlockSpec(block_shape=(None, None, None, gp), index_map=lambda i, j, s: (i, j, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((r, kh, splits, gp, h), q.dtype if splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((r, kh, splits, gp), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_decode_attention",
    )(starts.astype(jnp.int32), ends.astype(jnp.int32), qg, k_cache, v_cache)
    if splits == 1:
        out = o[:, :, 0]  # [R, K, Gp, H]
    else:  # partial outputs, each normalised over its split: weight them by their sums of exp
        w = jnp.exp(lse - jnp.max(lse, axis=2, keepdims=True))  # [R, K, S, Gp]
        out = jnp.sum(o * w[..., None], axis=2) / jnp.sum(w, axis=2)[..., None]
    return out[:, :, :g].reshape(r, 1, n, h).astype(q.dtype)
