"""Grouped matmul for mixture-of-experts layers: rows sorted by expert, each block by its own weights.

`grouped_matmul(lhs, rhs, group_sizes)` computes what `jax.lax.ragged_dot` does: rows
[o_g, o_g + group_sizes[g]) of `lhs` times `rhs[g]`, with o_g the sum of the earlier groups. XLA on
GPUs (jax 0.11.2) lowers `ragged_dot` by padding every group to the full row count and running one
dense dot over all experts: E times the FLOPs and memory of the real work (BENCHMARKS.md, the MoE
section). This module is a Pallas kernel with the Triton lowering that only touches each group's rows,
plus the two products its gradient needs, behind a `custom_vjp`:

  forward   out[M, N]   = lhs[M, C] @ rhs[g]           (rhs [E, C, N])
  d lhs     dlhs[M, C]  = dout[M, N] @ rhs[g]^T        (the same kernel, rhs read transposed)
  d rhs     drhs[g]     = lhs[rows of g]^T @ dout[rows of g]

Forward kernel: the rows are cut in tiles of `block_m`; a *visit* is one (tile, group) pair where the
group has rows in the tile. There are at most M / block_m + E - 1 visits (consecutive groups share at
most one tile), so the grid is a static (M / block_m + E, N / block_n); a visit past the real ones has
no rows and its contraction loop runs zero times. A program reads the group's row range, loads its
tile with a row mask, loops over the contraction in `block_k` steps, and stores only its group's rows:
programs that share a tile write disjoint rows. The weight-gradient kernel runs one program per
(group, C block, N block) and loops over the group's row tiles (a loop bound read at run time).

Rows past the sum of `group_sizes` come back as 0 (ragged_dot leaves them undefined). Off the GPU, or
for shapes the Triton dots cannot take (C or N not a multiple of 16), `grouped_matmul` is
`jax.lax.ragged_dot`; tests run the kernels in Pallas' interpreter.

Glossary: M rows, C contraction, N output columns, E groups (experts), V visits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MIN_DIM = 16  # Triton's dot needs every block dimension >= 16


def _pow2_at_most(x: int, cap: int) -> int:
    b = 16
    while b * 2 <= min(x, cap):
        b *= 2
    return b


def _block(dim: int, cap: int) -> int:
    """The largest power of two <= cap (and >= 16) that divides dim."""
    b = _pow2_at_most(dim, cap)
    while b > MIN_DIM and dim % b:
        b //= 2
    return b


def supported(c: int, n: int) -> bool:
    """Whether the Triton kernels take a [*, C] @ [C, N] grouped product."""
    return c % MIN_DIM == 0 and n % MIN_DIM == 0


def _offsets(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return ends - group_sizes.astype(jnp.int32), ends  # [E] first row, one past the last row


def _visits(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """(tile, group) of every visit, [V] each, V = ceil(M / block_m) + E; unused visits get group E."""
    e = group_sizes.shape[0]
    starts, ends = _offsets(group_sizes)
    first = starts // block_m
    count = jnp.where(group_sizes > 0, (ends - 1) // block_m - first + 1, 0)  # [E] tiles each group touches
    upto = jnp.cumsum(count)  # [E]
    v = jnp.arange(-(-m // block_m) + e, dtype=jnp.int32)
    group = jnp.searchsorted(upto, v, side="right").astype(jnp.int32)  # [V]; E past the real visits
    safe = jnp.minimum(group, e - 1)
    tile = first[safe] + v - (upto[safe] - count[safe])
    return jnp.where(group < e, tile, 0), group


def _gmm_kernel(tile_ref, group_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, *refs, block_m, block_n,
                block_k, transpose_rhs, precision):
    """One (visit, N block). tile_ref, group_ref [V]; starts_ref, ends_ref [E + 1]; lhs_ref [M, C];
    rhs_ref [E, C, N] (or [E, N, C] when transpose_rhs), or [L, E, C, N] with a layer_ref [1] naming the layer
    (the engine reading a stack of layers' experts in place); out_ref [M, N]."""
    *layer_ref, out_ref = refs
    at = (layer_ref[0][0],) if layer_ref else ()  # the layer's index in a stacked rhs
    v, j = pl.program_id(0), pl.program_id(1)
    tile, group = tile_ref[v], group_ref[v]
    lo, hi = starts_ref[group], ends_ref[group]
    rows = pl.ds(tile * block_m, block_m)
    row_ids = tile * block_m + jnp.arange(block_m, dtype=jnp.int32)  # [bm]
    valid = (row_ids >= lo) & (row_ids < hi)
    contraction = lhs_ref.shape[1]
    first = tile * block_m
    overlap = (lo < hi) & (lo < first + block_m) & (hi > first)  # (Triton has no reduce_or for any(valid))
    steps = overlap.astype(jnp.int32) * (contraction // block_k)  # (a select gives scf.for mixed types)
    g = jnp.minimum(group, rhs_ref.shape[len(at)] - 1)
    cols = pl.ds(j * block_n, block_n)

    def body(i, acc):
        ks = pl.ds(i * block_k, block_k)
        a = pltriton.load(lhs_ref.at[rows, ks], mask=valid[:, None], other=0)  # [bm, bk]
        if transpose_rhs:
            b = pltriton.load(rhs_ref.at[(*at, g, cols, ks)])  # [bn, bk]
            dims = (((1,), (1,)), ((), ()))
        else:
            b = pltriton.load(rhs_ref.at[(*at, g, ks, cols)])  # [bk, bn]
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(a, b.astype(a.dtype), dims, precision=precision,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(jnp.int32(0), steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    pltriton.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=valid[:, None])


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, block_m, precision):
    """One (group, C block, N block) of drhs[g] = lhs[rows of g]^T @ dout[rows of g]. starts_ref,
    ends_ref [E]; lhs_ref [M, C]; dout_ref [M, N]; out_ref [bc, bn] (this program's block)."""
    g = pl.program_id(0)
    bc, bn = out_ref.shape
    lo, hi = starts_ref[g], ends_ref[g]
    cs = pl.ds(pl.program_id(1) * bc, bc)
    ns = pl.ds(pl.program_id(2) * bn, bn)
    first = lax.div(lo, block_m)
    last = first + (hi > lo).astype(jnp.int32) * (lax.div(hi + block_m - 1, block_m) - first)

    def body(t, acc):
        rows = pl.ds(t * block_m, block_m)
        row_ids = t * block_m + jnp.arange(block_m, dtype=jnp.int32)
        valid = ((row_ids >= lo) & (row_ids < hi))[:, None]
        a = pltriton.load(lhs_ref.at[rows, cs], mask=valid, other=0)  # [bm, bc]
        d = pltriton.load(dout_ref.at[rows, ns], mask=valid, other=0)  # [bm, bn]
        return acc + lax.dot_general(a, d.astype(a.dtype), (((0,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(first, last, body, jnp.zeros((bc, bn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _full(shape):
    return pl.BlockSpec(block_shape=shape, index_map=lambda *_: (0,) * len(shape))


def _pad_rows(x: jax.Array, block_m: int) -> jax.Array:
    pad = -x.shape[0] % block_m
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "block_m", "interpret"))
def _gmm(lhs, rhs, group_sizes, layer=None, *, transpose_rhs: bool, block_m: int, interpret: bool):
    m, c = lhs.shape
    n = rhs.shape[-2] if transpose_rhs else rhs.shape[-1]
    block_n, block_k = _block(n, 128), _block(c, 64)
    x = _pad_rows(lhs, block_m)
    tile, group = _visits(group_sizes, x.shape[0], block_m)
    starts, ends = _offsets(group_sizes)
    starts, ends = jnp.append(starts, 0), jnp.append(ends, 0)  # group E: the empty visits
    kernel = functools.partial(_gmm_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               transpose_rhs=transpose_rhs, precision=lax.Precision.DEFAULT)
    layers = () if layer is None else (jnp.asarray(layer, jnp.int32).reshape(1),)
    out = pl.pallas_call(
        kernel,
        grid=(tile.shape[0], n // block_n),
        in_specs=[_full(tile.shape), _full(group.shape), _full(starts.shape), _full(ends.shape), _full(x.shape),
                  _full(rhs.shape)] + [_full((1,))] * len(layers),
        out_specs=_full((x.shape[0], n)),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), lhs.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="grouped_matmul",
    )(tile, group, starts, ends, x, rhs, *layers)[:m]
    total = jnp.sum(group_sizes)
    return jnp.where((jnp.arange(m) < total)[:, None], out, 0)  # unwritten rows (past the groups) -> 0


@functools.partial(jax.jit, static_argnames=("num_groups", "block_m", "interpret"))
def _tgmm(lhs, dout, group_sizes, *, num_groups: int, block_m: int, interpret: bool):
    c, n = lhs.shape[1], dout.shape[1]
    bc, bn = _block(c, 64), _block(n, 64)
    x, d = _pad_rows(lhs, block_m), _pad_rows(dout, block_m)
    starts, ends = _offsets(group_sizes)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, block_m=block_m, precision=lax.Precision.DEFAULT),
        grid=(num_groups, c // bc, n // bn),
        in_specs=[_full(starts.shape), _full(ends.shape), _full(x.shape), _full(d.shape)],
        out_specs=pl.BlockSpec(block_shape=(None, bc, bn), index_map=lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((num_groups, c, n), lhs.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="grouped_matmul_wgrad",
    )(starts, ends, x, d)


def default_block_m(m: int, num_groups: int) -> int:
    """Row tile: about the mean group size, between 16 and 128 (decode's few rows a group waste less)."""
    return max(MIN_DIM, min(128, _pow2_at_most(max(m // max(num_groups, 1), 1), 128)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(lhs, rhs, group_sizes, block_m, interpret):
    return _gmm(lhs, rhs, group_sizes, transpose_rhs=False, block_m=block_m, interpret=interpret)


def _grouped_fwd(lhs, rhs, group_sizes, block_m, interpret):
    return _grouped(lhs, rhs, group_sizes, block_m, interpret), (lhs, rhs, group_sizes)


def _grouped_bwd(block_m, interpret, res, dout):
    lhs, rhs, group_sizes = res
    dlhs = _gmm(dout, rhs, group_sizes, transpose_rhs=True, block_m=block_m, interpret=interpret)
    drhs = _tgmm(lhs, dout, group_sizes, num_groups=rhs.shape[0], block_m=block_m, interpret=interpret)
    return dlhs, drhs.astype(rhs.dtype), np.zeros(group_sizes.shape, jax.dtypes.float0)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, impl: str = "auto",
                   block_m: int | None = None, layer: int | None = None) -> jax.Array:
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` for MoE experts, differentiable.

    Args:
      lhs: [M, C], rows sorted by group; rhs: [E, C, N]; group_sizes: [E] int32 (sum <= M).
      impl: 'pallas' (the Triton kernels; interpreted off the GPU), 'xla' (`jax.lax.ragged_dot`), or
        'auto': the kernels on a GPU when `supported(C, N)`, else XLA.
      block_m: the kernels' row tile (a power of two >= 16); default `default_block_m`.
      layer: rhs is a stack of layers' experts [L, E, C, N] and this layer's are used, read in place by the
        kernel (no copy of the layer's slice); forward only (the sampler's).
    Returns:
      [M, N] in lhs's dtype; rows past sum(group_sizes) are 0 with the kernels.
    """
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"grouped_matmul impl={impl!r}: use 'auto', 'pallas' or 'xla'")
    _, c = lhs.shape
    stack, rhs_one = rhs, (rhs if layer is None else rhs[layer])
    e, c2, n = rhs_one.shape
    if c2 != c or group_sizes.shape != (e,):
        raise ValueError(f"grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape} "
                         "do not fit [M, C] x [E, C, N] with [E] group sizes")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        impl = "pallas" if on_gpu and supported(c, n) else "xla"
    if impl == "xla":
        return lax.ragged_dot(lhs, rhs_one, group_sizes)
    if not supported(c, n):
        raise ValueError(f"grouped_matmul impl='pallas': C={c} and N={n} must be multiples of {MIN_DIM}")
    bm = block_m or default_block_m(lhs.shape[0], e)
    if layer is not None:
        if stack.dtype != lhs.dtype:
            raise ValueError(f"grouped_matmul layer={layer}: the stacked experts ({stack.dtype}) must be in lhs's "
                             f"dtype ({lhs.dtype}) to be read in place")
        return _gmm(lhs, stack, group_sizes.astype(jnp.int32), layer, transpose_rhs=False, block_m=bm,
                    interpret=not on_gpu)
    return _grouped(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), bm, not on_gpu)
