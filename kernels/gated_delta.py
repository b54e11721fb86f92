"""The chunked gated delta rule (Gated DeltaNet, Qwen3.5's linear attention) with Pallas kernels, differentiable.

`chunked_gated_delta_rule_kernel` computes what `jaxrl_llm.models.gated_delta.chunked_gated_delta_rule` does
(same arguments, same outputs up to fp32 rounding); `models.gated_delta.gated_delta_rule` calls it on GPUs
where `kernel_supported` says the shapes fit. The chunked form has two kinds of work:

  * chunk-local terms, independent across chunks: the decays, the unit-lower-triangular system (I + L) of the
    WY form solved for the chunk's values (u) and for how the carried state enters them (w), the intra-chunk
    attention, and the masked queries and keys that read and write the state;
  * the scan over chunks, the only sequential part: with S [Dk, Dv] the state carried into chunk n,
        v_new = u - w S,   o = q_in S + attn v_new,   S <- keep S + k_out^T v_new.

Forward, two Pallas kernels (Triton lowering on GPUs; Pallas' interpreter elsewhere):
  1. `_wy_kernel`, one program a (batch, value head, chunk): L from the key head's Gram matrix, decays and
     beta, then (I + L)^-1 exactly by forward substitution written as dots (`unit_lower_inverse`: 16-row
     blocks, then block substitution), then u and w;
  2. `_scan_kernel`, one program a (batch, value head, Dv block): columns of S evolve independently, so Dv is
     cut in blocks of `block_v` for more programs. The program keeps its [Dk, block_v] slice of S in fp32
     through a `fori_loop` over chunks, forms each chunk's attn, q_in, k_out and keep from q, k and the decays,
     and writes o; under differentiation it also writes the state at every chunk's start ([N, Dk, Dv]).
q and k are read at key head h // (Hv / Hk) by the kernels' index maps: the grouped heads are not repeated.

Backward (a `jax.custom_vjp` around the whole op; residuals: the inputs, the chunk-start states and the WY
kernel's (I + L)^-1): the chunk-local terms are recomputed in jnp (`gated_delta_terms.chunk_terms`: the
reference's maths batched over chunks, the Gram matrices once per key head, the saved inverse with its own
gradient) and differentiated by `jax.vjp`. Between them, three kernels: `_dstate_kernel` runs the scan from the
last chunk to the first (grid batch x value head x Dv block), carrying dS and writing d v_new and dS after each
chunk; then, one program a chunk, `_grads_by_state_kernel` (dw, d q_in from S) and `_grads_by_values_kernel`
(v_new again, then d k_out, d attn, d keep). Memory stays O(T C) a head, plus [N, Dk, Dv] states.

Shapes: B batch, T time (Tp padded to a multiple of C), Hk key heads, Hv value heads (R = Hv / Hk), Dk key
dim, Dv value dim, C chunk (64), N chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels.gated_delta_terms import CHUNK, chunk_terms, unit_lower_inverse

IMPLS = ("auto", "pallas", "xla")
# 'auto' takes the kernels on GPUs. Validated on an H200 on 2026-11-28 (`--sections gated_delta`, benchmarks/NOTES.md
# item 55): at Qwen3.5-9B's heads in bf16 the outputs and the state agree with the XLA form within 9e-5 relative and
# the gradients within 3e-3, and forward plus backward ran 1.3-2.6x faster in less memory at every timed shape.
# JAXRL_GDN_KERNEL=0 in the environment keeps the XLA form on GPUs too, for A/B runs.
VALIDATED_ON_GPU = os.environ.get("JAXRL_GDN_KERNEL", "1") != "0"
MIN_DIM = 16  # Triton's dots need every dimension >= 16 (and powers of two)
MAX_DK = 256  # a program holds a [Dk, block_v] fp32 state (and its gradient) in registers


@dataclasses.dataclass(frozen=True)
class Config:
    """Static settings of the kernels (hashable: a `custom_vjp` non-differentiable argument)."""

    chunk: int = CHUNK
    block_v: int = 64  # Dv columns a scan program owns
    precision: lax.Precision | None = lax.Precision.HIGHEST  # dots on fp32 operands: IEEE, or TF32 (None)
    interpret: bool = False
    # (num_warps, num_stages) a kernel. Compiled offline by Triton 3.9 for sm_90 at Qwen3.5's shapes (bf16, Dk = Dv
    # = 128): shared memory for the dots' operands grows with the stages (the scan 66 KB at 1 stage, 182 KB at 2,
    # 266 KB at 3; the dS scan 82 KB at 1, 311 KB at 2: past the H100's 227 KB), so the loops run unpipelined.
    # 8 warps spill least (the scan 0.6 KB, the dS scan and the gradient kernels 0-0.2 KB; the WY kernel none), but
    # 4 run faster: timed on an H200 at the 9B's heads, 4 sequences of 4,096 (`--sections gated_delta`, 2026-11-28),
    # the forward took 4.25 ms with the scan at 8 warps and 3.17 ms at 4, forward and backward 12.78 ms with the scan,
    # dS scan and gradient kernels at 8 and 10.31 ms at 4.
    launch: tuple = (("wy", (4, 1)), ("scan", (4, 1)), ("dstate", (4, 1)), ("grads", (4, 1)))


def _is_pow2(x: int) -> bool:
    return x >= MIN_DIM and x & (x - 1) == 0


def _unsupported(q, k, v) -> str | None:
    """Why the kernels cannot take these shapes, or None."""
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        return f"q {q.shape}, k {k.shape}, v {v.shape} are not [B, T, Hk, Dk] x2 and [B, T, Hv, Dv]"
    hk, dk, hv, dv = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    if hv % hk:
        return f"{hv} value heads are not a multiple of {hk} key heads"
    if not (_is_pow2(dk) and _is_pow2(dv)) or dk > MAX_DK:
        return f"Dk={dk} and Dv={dv} must be powers of two >= {MIN_DIM} (Dk <= {MAX_DK})"
    return None


def kernel_supported(q, k, v, *, impl: str = "auto") -> bool:
    """Whether `gated_delta_rule(..., impl=impl)` runs the kernels on these shapes.

    'auto': on a GPU where the shapes fit; 'pallas': always (interpreted off the GPU; unfit shapes raise a
    ValueError rather than falling back silently); 'xla': never.
    """
    if impl not in IMPLS:
        raise ValueError(f"gated delta rule impl={impl!r}: use one of {IMPLS}")
    if impl == "xla":
        return False
    why = _unsupported(q, k, v)
    if impl == "pallas" and why:
        raise ValueError(f"gated delta rule impl='pallas': {why}")
    return why is None and (impl == "pallas" or (jax.default_backend() == "gpu" and VALIDATED_ON_GPU))


# ---- the scan kernels --------------------------------------------------------------------------------
def _mm(a, b, precision, *, ta=False, tb=False):
    """a @ b in fp32 (a^T with ta, b^T with tb)."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _wy_kernel(k_ref, v_ref, gc_ref, beta_ref, seg_ref, u_ref, w_ref, *a_ref, precision):
    """One (batch, value head, chunk): u = (I + L)^-1 (beta v), w = (I + L)^-1 (beta exp(gc) k) on the tokens
    that still see the carried state, L_ij = beta_i (k_i . k_j) exp(gc_i - gc_j) for j < i in the same row.
    k_ref [C, Dk] (the key head); v_ref [C, Dv]; gc_ref, beta_ref, seg_ref [C]; u_ref [C, Dv]; w_ref [C, Dk]."""
    k = k_ref[...]
    gc, beta, seg = gc_ref[...].astype(jnp.float32), beta_ref[...].astype(jnp.float32), seg_ref[...]
    c = gc.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    strict = (row > col) & (seg[:, None] == seg[None, :])
    decay = jnp.exp(jnp.where(strict, gc[:, None] - gc[None, :], 0.0))
    lmat = jnp.where(strict, _mm(k, k, precision, tb=True) * decay * beta[:, None], 0.0)
    a = unit_lower_inverse(lmat, lambda x, y: _mm(x, y, precision))
    into = jnp.where(seg == 0, jnp.exp(gc), 0.0) * beta
    u_ref[...] = _mm(a, v_ref[...].astype(jnp.float32) * beta[:, None], precision)
    w_ref[...] = _mm(a, k.astype(jnp.float32) * into[:, None], precision)
    if a_ref:  # the backward's residual
        a_ref[0][...] = a


def _chunk_reads(q, k, gc, seg, precision):
    """In-chunk terms from the raw inputs (as `chunk_terms`): attn [C, C], q_in, k_out [C, Dk] fp32, keep []."""
    c = gc.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    last = lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1
    g_last = jnp.sum(jnp.where(last, gc, 0.0))
    seg_last = jnp.sum(jnp.where(last, seg, 0))
    lower = (row >= col) & (seg[:, None] == seg[None, :])
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
    attn = _mm(q, k, precision, tb=True) * decay
    q_in = q.astype(jnp.float32) * jnp.where(seg == 0, jnp.exp(gc), 0.0)[:, None]
    k_out = k.astype(jnp.float32) * jnp.where(seg == seg_last, jnp.exp(g_last - gc), 0.0)[:, None]
    keep = jnp.where(seg_last == 0, jnp.exp(g_last), 0.0)
    return attn, q_in, k_out, keep


def _scan_kernel(u_ref, w_ref, q_ref, k_ref, gc_ref, seg_ref, s0_ref, o_ref, s_ref, *states_ref, chunk, precision):
    """One (batch, value head, Dv block), chunks in order. u_ref [Tp, bv]; w_ref [Tp, Dk]; q_ref, k_ref [Tp, Dk]
    (the key head); gc_ref, seg_ref [Tp]; s0_ref, s_ref [Dk, bv]; o_ref [Tp, bv]; states_ref (when the backward
    needs them) [N Dk, bv]."""
    dk = w_ref.shape[1]

    def body(n, s):  # s [Dk, bv] fp32: the state carried into chunk n
        rows = pl.ds(pl.multiple_of(n * chunk, chunk), chunk)
        if states_ref:
            states_ref[0][pl.ds(pl.multiple_of(n * dk, dk), dk), :] = s
        attn, q_in, k_out, keep = _chunk_reads(q_ref[rows, :], k_ref[rows, :], gc_ref[rows].astype(jnp.float32),
                                               seg_ref[rows], precision)
        v_new = u_ref[rows, :] - _mm(w_ref[rows, :], s, precision)  # [C, bv]
        o_ref[rows, :] = (_mm(q_in, s, precision) + _mm(attn, v_new, precision)).astype(o_ref.dtype)
        return s * keep + _mm(k_out, v_new, precision, ta=True)

    s_ref[...] = lax.fori_loop(0, seg_ref.shape[0] // chunk, body, s0_ref[...].astype(jnp.float32))


def _dstate_kernel(attn_ref, qin_ref, kout_ref, w_ref, keep_ref, do_ref, ds_ref, du_ref, dstates_ref, ds0_ref, *,
                   chunk, precision):
    """The backward's sequential part: one (batch, value head, Dv block), chunks in reverse, carrying dS (the
    cotangent of the state after chunk n). attn_ref [Tp, C]; qin_ref, kout_ref, w_ref [Tp, Dk]; keep_ref [N];
    do_ref [Tp, bv]; ds_ref, ds0_ref [Dk, bv] (the final and the initial state's cotangents). Writes
    du_ref [Tp, bv] (= d v_new) and dstates_ref [N Dk, bv] (dS after each chunk)."""
    dk = w_ref.shape[1]
    num = keep_ref.shape[0]

    def body(i, ds):
        n = num - 1 - i
        rows = pl.ds(pl.multiple_of(n * chunk, chunk), chunk)
        dstates_ref[pl.ds(pl.multiple_of(n * dk, dk), dk), :] = ds
        do = do_ref[rows, :].astype(jnp.float32)
        dv_new = _mm(attn_ref[rows, :], do, precision, ta=True) + _mm(kout_ref[rows, :], ds, precision)  # [C, bv]
        du_ref[rows, :] = dv_new
        return (ds * keep_ref[n] + _mm(qin_ref[rows, :], do, precision, ta=True)
                - _mm(w_ref[rows, :], dv_new, precision, ta=True))

    ds0_ref[...] = lax.fori_loop(0, num, body, ds_ref[...].astype(jnp.float32))


def _grads_by_state_kernel(states_ref, du_ref, do_ref, dw_ref, dqin_ref, *, block_v, precision):
    """One (batch, value head, chunk): dw = -du S^T, dq_in = do S^T, summed over Dv blocks. states_ref [Dk, Dv]
    (S at the chunk's start); du_ref, do_ref [C, Dv]; dw_ref, dqin_ref [C, Dk]."""
    c, dk = dw_ref.shape
    dw = jnp.zeros((c, dk), jnp.float32)
    dq = jnp.zeros((c, dk), jnp.float32)
    for j in range(states_ref.shape[1] // block_v):
        cols = pl.ds(j * block_v, block_v)
        s = states_ref[:, cols]
        dw = dw - _mm(du_ref[:, cols], s, precision, tb=True)
        dq = dq + _mm(do_ref[:, cols].astype(jnp.float32), s, precision, tb=True)
    dw_ref[...] = dw
    dqin_ref[...] = dq


def _grads_by_values_kernel(states_ref, dstates_ref, u_ref, w_ref, do_ref, dkout_ref, dattn_ref, dkeep_ref, *,
                            block_v, precision):
    """One (batch, value head, chunk): v_new = u - w S again, then dk_out = v_new dS^T, dattn = do v_new^T and
    the row sums of S * dS (d keep), summed over Dv blocks. states_ref, dstates_ref [Dk, Dv] (S at the chunk's
    start, dS after it); u_ref, do_ref [C, Dv]; w_ref [C, Dk]; dkout_ref [C, Dk]; dattn_ref [C, C]; dkeep_ref
    [Dk]."""
    c, dk = dkout_ref.shape
    w = w_ref[...]
    dkout = jnp.zeros((c, dk), jnp.float32)
    dattn = jnp.zeros((c, c), jnp.float32)
    dkeep = jnp.zeros((dk,), jnp.float32)
    for j in range(states_ref.shape[1] // block_v):
        cols = pl.ds(j * block_v, block_v)
        s, ds = states_ref[:, cols], dstates_ref[:, cols]
        v_new = u_ref[:, cols] - _mm(w, s, precision)
        dkout = dkout + _mm(v_new, ds, precision, tb=True)
        dattn = dattn + _mm(do_ref[:, cols].astype(jnp.float32), v_new, precision, tb=True)
        dkeep = dkeep + jnp.sum(s * ds, axis=1)
    dkout_ref[...] = dkout
    dattn_ref[...] = dattn
    dkeep_ref[...] = dkeep


def _spec(shape, index_map):
    return pl.BlockSpec(block_shape=shape, index_map=index_map)


def _params(cfg: Config, kernel: str):
    num_warps, num_stages = dict(cfg.launch)[kernel]
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _wy_call(cfg: Config, k, v, gc, beta, seg, *, inverse: bool):
    """u [B, Hv, Tp, Dv], w [B, Hv, Tp, Dk] and (with `inverse`) (I + L)^-1 [B, Hv, Tp, C], fp32: the WY form's
    chunk-local solves, one program a chunk."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    c, rep = cfg.chunk, hv // hk
    rows = lambda d: _spec((None, None, c, d), lambda i, h, n: (i, h, n, 0))
    out_specs, out_shape = [rows(dv), rows(dk)], [jax.ShapeDtypeStruct((b, hv, t, d), jnp.float32) for d in (dv, dk)]
    if inverse:
        out_specs.append(rows(c))
        out_shape.append(jax.ShapeDtypeStruct((b, hv, t, c), jnp.float32))
    return pl.pallas_call(
        functools.partial(_wy_kernel, precision=cfg.precision),
        grid=(b, hv, t // c),
        in_specs=[_spec((None, c, None, dk), lambda i, h, n: (i, n, lax.div(h, rep), 0)),
                  _spec((None, c, None, dv), lambda i, h, n: (i, n, h, 0)),
                  _spec((None, c, None), lambda i, h, n: (i, n, h)), _spec((None, c, None), lambda i, h, n: (i, n, h)),
                  _spec((None, c), lambda i, h, n: (i, n))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(cfg, "wy"),
        interpret=cfg.interpret,
        name="gated_delta_wy",
    )(k, v, gc, beta, seg)


def _scan_call(cfg: Config, u, w, q, k, gc, seg, s0, *, states: bool):
    """o [B, Tp, Hv, Dv], the final state [B, Hv, Dk, Dv] and (with `states`) the state at every chunk's start
    [B, Hv, N Dk, Dv]; all fp32."""
    b, hv, t, dv = u.shape
    hk, dk, bv, n = q.shape[2], w.shape[-1], min(cfg.block_v, dv), t // cfg.chunk
    rep = hv // hk
    by_block = lambda rows: _spec((None, None, rows, bv), lambda i, h, j: (i, h, 0, j))
    key_head = _spec((None, t, None, dk), lambda i, h, j: (i, 0, lax.div(h, rep), 0))
    out_specs = [_spec((None, t, None, bv), lambda i, h, j: (i, 0, h, j)), by_block(dk)]
    out_shape = [jax.ShapeDtypeStruct((b, t, hv, dv), jnp.float32), jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32)]
    if states:
        out_specs.append(by_block(n * dk))
        out_shape.append(jax.ShapeDtypeStruct((b, hv, n * dk, dv), jnp.float32))
    return pl.pallas_call(
        functools.partial(_scan_kernel, chunk=cfg.chunk, precision=cfg.precision),
        grid=(b, hv, dv // bv),
        in_specs=[by_block(t), _spec((None, None, t, dk), lambda i, h, j: (i, h, 0, 0)), key_head, key_head,
                  _spec((None, t, None), lambda i, h, j: (i, 0, h)), _spec((None, t), lambda i, h, j: (i, 0)),
                  by_block(dk)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(cfg, "scan"),
        interpret=cfg.interpret,
        name="gated_delta_scan",
    )(u, w, q, k, gc, seg, s0)


def _scan_bwd_call(cfg: Config, u, w, attn, q_in, k_out, keep, states, do, ds):
    """The cotangents of (u, w, attn, q_in, k_out, keep, s0) given those of (o, final state): the sequential
    dS scan, then two kernels over chunks in parallel for the gradients that need S."""
    b, hv, t, dv = u.shape
    dk, n, bv, c = w.shape[-1], keep.shape[-1], min(cfg.block_v, dv), cfg.chunk
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    per_head = lambda d: _spec((None, None, t, d), lambda i, h, j: (i, h, 0, 0))
    by_block = lambda rows: _spec((None, None, rows, bv), lambda i, h, j: (i, h, 0, j))
    du, dstates, ds0 = pl.pallas_call(
        functools.partial(_dstate_kernel, chunk=c, precision=cfg.precision),
        grid=(b, hv, dv // bv),
        in_specs=[per_head(c), per_head(dk), per_head(dk), per_head(dk),
                  _spec((None, None, n), lambda i, h, j: (i, h, 0)),
                  _spec((None, t, None, bv), lambda i, h, j: (i, 0, h, j)), by_block(dk)],
        out_specs=[by_block(t), by_block(n * dk), by_block(dk)],
        out_shape=[f32(b, hv, t, dv), f32(b, hv, n * dk, dv), f32(b, hv, dk, dv)],
        compiler_params=_params(cfg, "dstate"),
        interpret=cfg.interpret,
        name="gated_delta_dstate",
    )(attn, q_in, k_out, w, keep, do, ds)
    chunk_rows = lambda d: _spec((None, None, c, d), lambda i, h, m: (i, h, m, 0))
    state_n = _spec((None, None, dk, dv), lambda i, h, m: (i, h, m, 0))
    do_n = _spec((None, c, None, dv), lambda i, h, m: (i, m, h, 0))
    dw, dqin = pl.pallas_call(
        functools.partial(_grads_by_state_kernel, block_v=bv, precision=cfg.precision),
        grid=(b, hv, n),
        in_specs=[state_n, chunk_rows(dv), do_n],
        out_specs=[chunk_rows(dk), chunk_rows(dk)],
        out_shape=[f32(b, hv, t, dk), f32(b, hv, t, dk)],
        compiler_params=_params(cfg, "grads"),
        interpret=cfg.interpret,
        name="gated_delta_grads_by_state",
    )(states, du, do)
    dkout, dattn, dkeep = pl.pallas_call(
        functools.partial(_grads_by_values_kernel, block_v=bv, precision=cfg.precision),
        grid=(b, hv, n),
        in_specs=[state_n, state_n, chunk_rows(dv), chunk_rows(dk), do_n],
        out_specs=[chunk_rows(dk), chunk_rows(c), _spec((None, None, dk), lambda i, h, m: (i, h, m))],
        out_shape=[f32(b, hv, t, dk), f32(b, hv, t, c), f32(b, hv, n * dk)],
        compiler_params=_params(cfg, "grads"),
        interpret=cfg.interpret,
        name="gated_delta_grads_by_values",
    )(states, dstates, u, w, do)
    dkeep = dkeep.reshape(b, hv, n, dk).sum(-1)
    return (du, dw, dattn, dqin, dkout, dkeep), ds0


# ---- the differentiable op ---------------------------------------------------------------------------
def _forward(q, k, v, g, beta, s0, seg, cfg: Config, *, residuals: bool):
    """(o, final state), and with `residuals` the chunk-start states and the chunks' (I + L)^-1."""
    b, t, hv = g.shape
    gc = jnp.cumsum(g.astype(jnp.float32).reshape(b, t // cfg.chunk, cfg.chunk, hv), axis=2).reshape(b, t, hv)
    u, w, *inverse = _wy_call(cfg, k, v, gc, beta, seg, inverse=residuals)
    return (*_scan_call(cfg, u, w, q, k, gc, seg, s0, states=residuals), *inverse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _gated_delta(q, k, v, g, beta, s0, seg, cfg: Config):
    return tuple(_forward(q, k, v, g, beta, s0, seg, cfg, residuals=False))


def _gated_delta_fwd(q, k, v, g, beta, s0, seg, cfg):
    o, s, states, inverse = _forward(q, k, v, g, beta, s0, seg, cfg, residuals=True)
    return (o, s), (q, k, v, g, beta, seg, states, inverse)


def _gated_delta_bwd(cfg, res, cts):
    q, k, v, g, beta, seg, states, inverse = res
    do, ds = cts
    terms, pullback = jax.vjp(lambda *x: chunk_terms(*x, seg, cfg.chunk, inverse=inverse), q, k, v, g, beta)
    dterms, ds0 = _scan_bwd_call(cfg, *terms, states, do, ds)
    return (*pullback(dterms), ds0, np.zeros(seg.shape, jax.dtypes.float0))


_gated_delta.defvjp(_gated_delta_fwd, _gated_delta_bwd)


def chunked_gated_delta_rule_kernel(q, k, v, g, beta, *, initial_state=None, resets=None, valid=None,
                                    chunk: int = CHUNK, block_v: int = 64, precision=None,
                                    interpret: bool | None = None, launch: dict | None = None):
    """`models.gated_delta.chunked_gated_delta_rule` through the kernels, differentiable.

    Args:
      q, k: [B, T, Hk, Dk] (L2-normalised; q scaled by Dk^-0.5); v: [B, T, Hv, Dv]; g (log decay <= 0),
        beta: [B, T, Hv]; any float dtype (bf16 or fp32), computed in fp32.
      initial_state: [B, Hv, Dk, Dv] or None (zeros).
      resets: [B, T] bool or None: the state is zeroed before token t (packed rows).
      valid: [B, T] bool or None: invalid tokens are identity steps.
      chunk: C; block_v: the scan's Dv block (programs = B Hv Dv / block_v).
      precision: of the kernels' dots (all on fp32 operands). None: IEEE fp32 when the inputs are fp32, TF32
        (as XLA's default on GPUs) when they are narrower.
      interpret: Pallas' interpreter (None: when the default backend is not a GPU).
      launch: {kernel: (num_warps, num_stages)} over `Config.launch`'s (kernels 'wy', 'scan', 'dstate', 'grads').
    Returns:
      o [B, T, Hv, Dv] fp32, final state [B, Hv, Dk, Dv] fp32.
    """
    why = _unsupported(q, k, v)
    if why:
        raise ValueError(f"chunked_gated_delta_rule_kernel: {why}")
    b, t = q.shape[:2]
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    if precision is None:
        wide = all(jnp.dtype(x.dtype) == jnp.float32 for x in (q, k, v))
        precision = lax.Precision.HIGHEST if wide else lax.Precision.DEFAULT
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    cfg = Config(chunk=chunk, block_v=min(block_v, dv), precision=precision, interpret=interpret)
    if launch:
        cfg = dataclasses.replace(cfg, launch=tuple({**dict(cfg.launch), **launch}.items()))
    if valid is not None:  # identity steps: g = beta = k = 0
        keep = valid.astype(bool)
        g = jnp.where(keep[..., None], g, jnp.zeros((), g.dtype))
        beta = jnp.where(keep[..., None], beta, jnp.zeros((), beta.dtype))
        k = jnp.where(keep[..., None, None], k, jnp.zeros((), k.dtype))
    resets = jnp.zeros((b, t), bool) if resets is None else resets.astype(bool)
    pad = -t % chunk
    if pad:  # identity steps at the end (q and v are free: zeros)
        zpad = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        q, k, v, g, beta, resets = map(zpad, (q, k, v, g, beta, resets))
    seg = jnp.cumsum(resets.reshape(b, -1, chunk).astype(jnp.int32), axis=-1).reshape(b, t + pad)
    s0 = jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    o, s = _gated_delta(q, k, v, g, beta, s0, seg, cfg)
    return o[:, :t], s
