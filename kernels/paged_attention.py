"""Paged decode attention: one query token per slot, its K/V read through a block table.

The paged sampler keeps K/V in per-layer pools of pages, [K, P, ps, H] (jaxrl_llm/rollout/page_pool.py
says who owns which page). Position p of slot s lives in page `block_tables[s, p // ps]` at offset
`p % ps`, and the step attends to positions [0, lengths[s]). The pages of a slot need not be adjacent
or in order, and slots may share pages (the `n` samples of a prompt share its prompt pages). Entries of a
block table past the slot's last page may hold anything in [0, P) (the sampler leaves them at its scratch
page 0); a slot with length <= 0 reads nothing and returns zeros (a finished slot).

Pallas with the Triton lowering on GPU; interpret mode elsewhere (tests). Grid (slot, kv head, split):
a program reads its slot's length and block-table row as ordinary per-slot inputs (the Triton backend
has no scalar prefetch), loads the G query heads of its kv head (padded to 16 rows, the smallest Triton
dot), and loops over steps of `pages_per_block` pages. A step looks up the page of each of its positions
in the table and gathers those K/V rows from the kv head's whole pool with masked loads, so nothing at
or past the slot's length is ever read, garbage table entries included. Online softmax in fp32, and
`num_splits` > 1 combines partial outputs by their log-sum-exp, as in kernels/decode_attention.py.

Glossary: S slots, N q heads, K kv heads, G = N // K, P pages in the pool, ps page size, W block-table
width (pages a slot can hold), H head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels.decode_attention import (
    _M_INIT,
    MASK_VALUE,
    MIN_GROUP_ROWS,
    _default_splits,
    _next_pow2,
    decode_attention_reference,
)

MIN_BLOCK = 16  # Triton's dot needs K and N >= 16: a loop step covers at least this many positions
TARGET_BLOCK = 64  # positions a loop step covers by default (the dense kernel's block_kv)


@jax.jit
def paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths):
    """The sampler's decode attention in jnp on a paged cache: the pages gathered into a dense cache,
    then `decode_attention_reference` on slots [0, lengths).

    Args:
      q: [S, N, H] one query per slot (after RoPE).
      k_pages, v_pages: [K, P, ps, H].
      block_tables: [S, W] int32; position p of slot s lives in page block_tables[s, p // ps], offset p % ps.
      lengths: [S] int32; slot s attends to positions [0, lengths[s]) (clipped to W * ps).
    Returns:
      [S, N, H] in q's dtype; zeros for a slot with lengths <= 0.
    """
    s, _, h = q.shape
    kh, _, ps, _ = k_pages.shape
    w = block_tables.shape[1]

    def dense(pages):  # [K, P, ps, H] -> [S, K, W * ps, H]
        return jnp.swapaxes(pages[:, block_tables].reshape(kh, s, w * ps, h), 0, 1)

    out = decode_attention_reference(q[:, None], dense(k_pages), dense(v_pages), jnp.zeros_like(lengths), lengths)
    return out[:, 0]


def _kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, page_size: int, block: int,
            num_splits: int, scale: float, precision):
    """One (slot, kv head, split). lengths_ref []; table_ref [W]; q_ref [Gp, H]; k_ref, v_ref [P, ps, H]
    (the kv head's whole pool); o_ref [Gp, H]; lse_ref [Gp]."""
    width = table_ref.shape[0]
    split = pl.program_id(2)
    length = jnp.minimum(jnp.maximum(lengths_ref[()], 0), width * page_size)
    steps = lax.div(length + (block - 1), block)
    per_split = lax.div(steps + (num_splits - 1), num_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, steps)

    q = q_ref[...]
    gp, h = q.shape
    offsets = jnp.arange(block, dtype=jnp.int32)
    dims = jnp.arange(h, dtype=jnp.int32)[None, :]  # [1, H]

    def body(i, carry):
        acc, m, denom = carry  # [Gp, H], [Gp] running max, [Gp] running sum of exp; fp32
        pos = i * block + offsets  # [bk] positions of this step
        valid = pos < length
        # The page of every position (repeated ps times: cached loads), then a gather of K/V rows.
        # Masked: positions at or past the length read neither the table nor the pool.
        page = pltriton.load(table_ref.at[lax.div(pos, page_size)], mask=valid, other=0)  # [bk]
        rows = (page[:, None], lax.rem(pos, page_size)[:, None], dims)  # -> [bk, H]
        k = pltriton.load(k_ref.at[rows], mask=valid[:, None], other=0)  # [bk, H]
        v = pltriton.load(v_ref.at[rows], mask=valid[:, None], other=0)
        s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [Gp, bk] fp32
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


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def default_pages_per_block(page_size: int) -> int:
    """Pages a loop step reads by default: the fewest (a power of two) that cover TARGET_BLOCK positions."""
    return _next_pow2(-(-TARGET_BLOCK // page_size))


def _triton_shapes_ok(block: int, head_dim: int) -> bool:
    return _is_pow2(block) and block >= MIN_BLOCK and _is_pow2(head_dim) and head_dim >= 16


def paged_attention_supported(page_size: int, head_dim: int) -> bool:
    """Whether the Triton kernel runs these shapes on a GPU with the default pages_per_block: a
    power-of-two page size and a power-of-two head dim >= 16."""
    return _is_pow2(page_size) and _triton_shapes_ok(page_size * default_pages_per_block(page_size), head_dim)


@functools.partial(jax.jit, static_argnames=("pages_per_block", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, pages_per_block: int | None = None,
                           num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                           interpret: bool | None = None):
    """Decode attention of one query per slot over its positions [0, lengths) in a paged cache.

    Same semantics as `paged_decode_attention_reference`; reads only the pages that hold the positions.

    Args:
      q: [S, N, H] one query per slot (after RoPE), bf16 or fp32.
      k_pages, v_pages: [K, P, ps, H], read in place (same dtype as q).
      block_tables: [S, W] int32, page ids in [0, P); entries past a slot's pages are never read.
      lengths: [S] int32; slot s attends to positions [0, lengths[s]) (clipped to [0, W * ps]).
      pages_per_block: pages a loop step reads, a power of two (None: `default_pages_per_block`, a step
        of >= 64 positions). On GPU, pages_per_block * ps must be a power of two >= 16.
      num_splits: programs a (slot, kv head) is split over (None: 1 on large batches, more on small).
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel in Pallas' interpreter (None: when the default backend is not a GPU).
    Returns:
      [S, N, H] in q's dtype.
    """
    s, n, h = q.shape
    kh, _, ps, _ = k_pages.shape
    w = block_tables.shape[1]
    if k_pages.shape != v_pages.shape or k_pages.shape[3] != h or n % kh:
        raise ValueError(f"q {q.shape} and pages {k_pages.shape}, {v_pages.shape} do not fit: want q [S, N, H] "
                         "and k_pages, v_pages [K, P, ps, H] alike, with N a multiple of K")
    if block_tables.shape[0] != s or lengths.shape != (s,):
        raise ValueError(f"block_tables {block_tables.shape} and lengths {lengths.shape} must be [S, W] and [S] "
                         f"with S = {s}")
    g = n // kh
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    ppb = pages_per_block or default_pages_per_block(ps)
    if not _is_pow2(ppb):
        raise ValueError(f"pages_per_block must be a power of two (got {ppb})")
    block = ppb * ps
    if not interpret and not _triton_shapes_ok(block, h):
        raise ValueError(f"the Triton kernel needs pages_per_block * page_size ({ppb} * {ps}) a power of two "
                         f">= {MIN_BLOCK} (a power-of-two page size) and a power-of-two head dim >= 16 (got {h})")
    steps = -(-w // ppb)  # loop steps of the longest slot
    splits = num_splits or (1 if interpret else _default_splits(s * kh, steps))
    gp = max(MIN_GROUP_ROWS, _next_pow2(g))
    qg = q.reshape(s, kh, g, h)  # [S, K, G, H]
    if gp > g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [S, K, Gp, H]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, page_size=ps, block=block, num_splits=splits, scale=h ** -0.5,
                               precision=precision)
    pool = pl.BlockSpec(block_shape=(None, *k_pages.shape[1:]), index_map=lambda i, j, t: (j, 0, 0, 0))
    o, lse = pl.pallas_call(
        kernel,
        grid=(s, kh, splits),
        in_specs=[pl.BlockSpec(block_shape=(None,), index_map=lambda i, j, t: (i,)),
                  pl.BlockSpec(block_shape=(None, w), index_map=lambda i, j, t: (i, 0)),
                  pl.BlockSpec(block_shape=(None, None, gp, h), index_map=lambda i, j, t: (i, j, 0, 0)),
                  pool, pool],
        out_specs=[pl.BlockSpec(block_shape=(None, None, None, gp, h), index_map=lambda i, j, t: (i, j, t, 0, 0)),
                   pl.BlockSpec(block_shape=(None, None, None, gp), index_map=lambda i, j, t: (i, j, t, 0))],
        out_shape=[jax.ShapeDtypeStruct((s, kh, splits, gp, h), q.dtype if splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((s, kh, splits, gp), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(lengths.astype(jnp.int32), block_tables.astype(jnp.int32), qg, k_pages, v_pages)
    if splits == 1:
        out = o[:, :, 0]  # [S, K, Gp, H]
    else:  # partial outputs, each normalised over its split: weight them by their sums of exp
        weight = jnp.exp(lse - jnp.max(lse, axis=2, keepdims=True))  # [S, K, splits, Gp]
        out = jnp.sum(o * weight[..., None], axis=2) / jnp.sum(weight, axis=2)[..., None]
    return out[:, :, :g].reshape(s, n, h).astype(q.dtype)
