"""The chunked gated delta rule (Gated DeltaNet, Qwen3.5's linear attention) with Pallas kernels, differentiable.

`chunked_gated_delta_rule_kernel` computes what `jaxrl_llm.models.gated_delta.chunked_gated_delta_rule` does
(same arguments, same outputs up to fp32 rounding); `models.gated_delta.gated_delta_rule` calls it on GPUs
where `kernel_supported` says the shapes fit. The chunked form splits into two kinds of work:

  * chunk-local terms, independent across chunks: the decays, the unit-lower-triangular system
    (I + L) of the WY form and its solution for the chunk's values (u) and for how the carried state enters
    them (w), the intra-chunk attention, and the masked queries and keys that read and write the state;
  * the scan over chunks, the only sequential part: with S [Dk, Dv] the state carried into chunk n,
        v_new = u - w S,   o = q_in S + attn v_new,   S <- keep S + k_out^T v_new.

The scan is a Pallas kernel (Triton lowering; Pallas' interpreter off GPU) with grid (batch, value head,
Dv block): columns of S evolve independently, so Dv is cut in blocks of `block_v` to give the GPU more
programs. A program keeps its [Dk, block_v] slice of S in fp32 through a `fori_loop` over the chunks, and
writes the state at every chunk boundary ([N, Dk, Dv], the backward's residual). The backward is a second
kernel, the same loop run from the last chunk to the first: it reloads each boundary state and recomputes
v_new, carrying dS, and writes the gradients of every term (those summed over Dv as one partial per Dv
block, added in jnp). The chunk-local terms are jnp, batched over chunks (`chunk_terms`, the reference's
maths, with the key heads' Gram matrices computed once per key head, not once per value head); in the
backward they are recomputed and differentiated by `jax.vjp`, so memory stays O(T C) a head.

The `jax.custom_vjp` sits around the whole op (terms and scan): it saves the inputs and the boundary states,
not the terms.

Shapes: B batch, T time (Tp padded to a multiple of C), Hk key heads, Hv value heads (R = Hv / Hk),
Dk key dim, Dv value dim, C chunk (64), N chunks, V Dv blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

CHUNK = 64
IMPLS = ("auto", "pallas", "xla")
MIN_DIM = 16  # Triton's dots need every dimension >= 16 (and powers of two)
MAX_DK = 256  # a program holds a [Dk, block_v] fp32 state (and its gradient) in registers


@dataclasses.dataclass(frozen=True)
class Config:
    """Static settings of the kernels (hashable: a `custom_vjp` non-differentiable argument)."""

    chunk: int = CHUNK
    block_v: int = 64  # Dv columns a scan program owns
    precision: lax.Precision | None = lax.Precision.HIGHEST  # dots on fp32 operands: IEEE, or TF32 (None)
    interpret: bool = False
    num_warps: int = 4
    num_stages: int = 2


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
    return why is None and (impl == "pallas" or jax.default_backend() == "gpu")


# ---- chunk-local terms (jnp) ------------------------------------------------------------------------
def chunk_terms(q, k, v, g, beta, seg, chunk: int = CHUNK):
    """The chunk-local terms of the WY form, in the scan kernels' layout (the reference's maths).

    Args:
      q, k: [B, Tp, Hk, Dk] (k zero on invalid tokens); v: [B, Tp, Hv, Dv]; g, beta: [B, Tp, Hv] (zero on
        invalid tokens); any float dtype, computed in fp32. Tp is a multiple of `chunk`.
      seg: [B, Tp] int32, resets so far in the token's chunk (up to and including it).
    Returns:
      u [B, Hv, Tp, Dv], w [B, Hv, Tp, Dk], attn [B, Hv, Tp, C], q_in [B, Hv, Tp, Dk], k_out [B, Hv, Tp, Dk],
      keep [B, Hv, N]; all fp32.
    """
    f32 = jnp.float32
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    r, n = hv // hk, t // chunk
    # [B, Hk, 1 or R, N, C, ...]: key heads outermost, so value head h = key head * R + its index in the group
    keys = lambda a: a.astype(f32).reshape(b, n, chunk, hk, 1, dk).transpose(0, 3, 4, 1, 2, 5)
    q, k = keys(q), keys(k)
    v = v.astype(f32).reshape(b, n, chunk, hk, r, dv).transpose(0, 3, 4, 1, 2, 5)  # [B, Hk, R, N, C, Dv]
    scalars = lambda a: a.astype(f32).reshape(b, n, chunk, hk, r).transpose(0, 3, 4, 1, 2)  # [B, Hk, R, N, C]
    g, beta = scalars(g), scalars(beta)
    seg = seg.reshape(b, 1, 1, n, chunk)
    carried = seg == 0  # the token still sees the state carried into the chunk
    same = seg[..., :, None] == seg[..., None, :]  # no reset in (j, i]
    idx = jnp.arange(chunk)
    lower = (idx[:, None] >= idx[None, :]) & same
    strict = (idx[:, None] > idx[None, :]) & same

    cum = jnp.cumsum(g, axis=-1)  # [B, Hk, R, N, C]
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # [B, Hk, R, N, C, C]
    kk = jnp.einsum("...ik,...jk->...ij", k, k)  # [B, Hk, 1, N, C, C]: once per key head
    qk = jnp.einsum("...ik,...jk->...ij", q, k)
    system = jnp.eye(chunk, dtype=f32) + jnp.where(strict, kk * decay * beta[..., :, None], 0.0)
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
    into = jnp.exp(cum) * carried  # [B, Hk, R, N, C]
    u = solve(v * beta[..., None])
    w = solve(k * (beta * into)[..., None])
    attn = qk * decay
    q_in = q * into[..., None]
    k_out = k * (jnp.exp(cum[..., -1:] - cum) * (seg == seg[..., -1:]))[..., None]
    keep = jnp.exp(cum[..., -1]) * carried[..., -1]  # [B, Hk, R, N]
    flat = lambda a: jnp.broadcast_to(a, (b, hk, r, *a.shape[3:])).reshape(b, hv, t, a.shape[-1])
    return flat(u), flat(w), flat(attn), flat(q_in), flat(k_out), keep.reshape(b, hv, n)


# ---- the scan kernels --------------------------------------------------------------------------------
def _mm(a, b, precision, *, ta=False, tb=False):
    """a @ b in fp32 (a^T with ta, b^T with tb)."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _scan_kernel(u_ref, w_ref, attn_ref, qin_ref, kout_ref, keep_ref, s0_ref, o_ref, s_ref, states_ref, *,
                 chunk, precision):
    """One (batch, value head, Dv block), chunks in order. u_ref [Tp, bv]; w_ref, qin_ref, kout_ref [Tp, Dk];
    attn_ref [Tp, C]; keep_ref [N]; s0_ref, s_ref [Dk, bv]; o_ref [Tp, bv]; states_ref [N Dk, bv]."""
    dk = w_ref.shape[1]

    def body(n, s):  # s [Dk, bv] fp32: the state carried into chunk n
        rows = pl.ds(pl.multiple_of(n * chunk, chunk), chunk)
        states_ref[pl.ds(pl.multiple_of(n * dk, dk), dk), :] = s
        v_new = u_ref[rows, :] - _mm(w_ref[rows, :], s, precision)  # [C, bv]
        o = _mm(qin_ref[rows, :], s, precision) + _mm(attn_ref[rows, :], v_new, precision)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        return s * keep_ref[n] + _mm(kout_ref[rows, :], v_new, precision, ta=True)

    s_ref[...] = lax.fori_loop(0, keep_ref.shape[0], body, s0_ref[...].astype(jnp.float32))


def _scan_bwd_kernel(u_ref, w_ref, attn_ref, qin_ref, kout_ref, keep_ref, states_ref, do_ref, ds_ref,
                     du_ref, dw_ref, dattn_ref, dqin_ref, dkout_ref, dkeep_ref, ds0_ref, *, chunk, precision):
    """One (batch, value head, Dv block), chunks in reverse. Inputs as `_scan_kernel`'s, plus states_ref
    [N Dk, bv], do_ref [Tp, bv], ds_ref [Dk, bv] (the final state's cotangent). Outputs: du_ref [Tp, bv];
    this block's share of dw_ref, dqin_ref, dkout_ref [Tp, Dk], dattn_ref [Tp, C] and dkeep_ref [N Dk]
    (row sums of S * dS); ds0_ref [Dk, bv]."""
    dk = w_ref.shape[1]
    num = keep_ref.shape[0]

    def body(i, ds):  # ds [Dk, bv]: the cotangent of the state after chunk n
        n = num - 1 - i
        rows = pl.ds(pl.multiple_of(n * chunk, chunk), chunk)
        dks = pl.ds(pl.multiple_of(n * dk, dk), dk)
        s = states_ref[dks, :]
        w, q_in, k_out = w_ref[rows, :], qin_ref[rows, :], kout_ref[rows, :]
        do = do_ref[rows, :].astype(jnp.float32)
        v_new = u_ref[rows, :] - _mm(w, s, precision)
        dv_new = _mm(attn_ref[rows, :], do, precision, ta=True) + _mm(k_out, ds, precision)  # [C, bv]
        du_ref[rows, :] = dv_new
        dw_ref[rows, :] = -_mm(dv_new, s, precision, tb=True)
        dattn_ref[rows, :] = _mm(do, v_new, precision, tb=True)
        dqin_ref[rows, :] = _mm(do, s, precision, tb=True)
        dkout_ref[rows, :] = _mm(v_new, ds, precision, tb=True)
        dkeep_ref[dks] = jnp.sum(s * ds, axis=1)
        return ds * keep_ref[n] + _mm(q_in, do, precision, ta=True) - _mm(w, dv_new, precision, ta=True)

    ds0_ref[...] = lax.fori_loop(0, num, body, ds_ref[...].astype(jnp.float32))


def _spec(shape, index_map):
    return pl.BlockSpec(block_shape=shape, index_map=index_map)


def _scan_call(cfg: Config, u, w, attn, q_in, k_out, keep, s0):
    """o [B, Tp, Hv, Dv], final state [B, Hv, Dk, Dv], boundary states [B, Hv, N Dk, Dv]; all fp32."""
    b, hv, t, dv = u.shape
    dk, n, bv = w.shape[-1], keep.shape[-1], min(cfg.block_v, dv)
    per_head = lambda d: _spec((None, None, t, d), lambda i, h, j: (i, h, 0, 0))
    by_block = lambda rows: _spec((None, None, rows, bv), lambda i, h, j: (i, h, 0, j))
    return pl.pallas_call(
        functools.partial(_scan_kernel, chunk=cfg.chunk, precision=cfg.precision),
        grid=(b, hv, dv // bv),
        in_specs=[by_block(t), per_head(dk), per_head(cfg.chunk), per_head(dk), per_head(dk),
                  _spec((None, None, n), lambda i, h, j: (i, h, 0)), by_block(dk)],
        out_specs=[_spec((None, t, None, bv), lambda i, h, j: (i, 0, h, j)), by_block(dk), by_block(n * dk)],
        out_shape=[jax.ShapeDtypeStruct((b, t, hv, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, hv, n * dk, dv), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="gated_delta_scan",
    )(u, w, attn, q_in, k_out, keep, s0)


def _scan_bwd_call(cfg: Config, u, w, attn, q_in, k_out, keep, states, do, ds):
    """The cotangents of (u, w, attn, q_in, k_out, keep, s0) given those of (o, final state)."""
    b, hv, t, dv = u.shape
    dk, n, bv, c = w.shape[-1], keep.shape[-1], min(cfg.block_v, dv), cfg.chunk
    nv = dv // bv
    per_head = lambda d: _spec((None, None, t, d), lambda i, h, j: (i, h, 0, 0))
    by_block = lambda rows: _spec((None, None, rows, bv), lambda i, h, j: (i, h, 0, j))
    partial = lambda d: _spec((None, None, None, t, d), lambda i, h, j: (j, i, h, 0, 0))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    du, dw, dattn, dqin, dkout, dkeep, ds0 = pl.pallas_call(
        functools.partial(_scan_bwd_kernel, chunk=c, precision=cfg.precision),
        grid=(b, hv, nv),
        in_specs=[by_block(t), per_head(dk), per_head(c), per_head(dk), per_head(dk),
                  _spec((None, None, n), lambda i, h, j: (i, h, 0)), by_block(n * dk),
                  _spec((None, t, None, bv), lambda i, h, j: (i, 0, h, j)), by_block(dk)],
        out_specs=[by_block(t), partial(dk), partial(c), partial(dk), partial(dk),
                   _spec((None, None, None, n * dk), lambda i, h, j: (j, i, h, 0)), by_block(dk)],
        out_shape=[f32(b, hv, t, dv), f32(nv, b, hv, t, dk), f32(nv, b, hv, t, c), f32(nv, b, hv, t, dk),
                   f32(nv, b, hv, t, dk), f32(nv, b, hv, n * dk), f32(b, hv, dk, dv)],
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="gated_delta_scan_bwd",
    )(u, w, attn, q_in, k_out, keep, states, do, ds)
    dkeep = dkeep.sum(0).reshape(b, hv, n, dk).sum(-1)
    return (du, dw.sum(0), dattn.sum(0), dqin.sum(0), dkout.sum(0), dkeep), ds0


# ---- the differentiable op ---------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _gated_delta(q, k, v, g, beta, s0, seg, cfg: Config):
    o, s, _ = _scan_call(cfg, *chunk_terms(q, k, v, g, beta, seg, cfg.chunk), s0)
    return o, s


def _gated_delta_fwd(q, k, v, g, beta, s0, seg, cfg):
    o, s, states = _scan_call(cfg, *chunk_terms(q, k, v, g, beta, seg, cfg.chunk), s0)
    return (o, s), (q, k, v, g, beta, seg, states)


def _gated_delta_bwd(cfg, res, cts):
    q, k, v, g, beta, seg, states = res
    do, ds = cts
    terms, pullback = jax.vjp(lambda *x: chunk_terms(*x, seg, cfg.chunk), q, k, v, g, beta)
    dterms, ds0 = _scan_bwd_call(cfg, *terms, states, do, ds)
    return (*pullback(dterms), ds0, np.zeros(seg.shape, jax.dtypes.float0))


_gated_delta.defvjp(_gated_delta_fwd, _gated_delta_bwd)


def chunked_gated_delta_rule_kernel(q, k, v, g, beta, *, initial_state=None, resets=None, valid=None,
                                    chunk: int = CHUNK, block_v: int = 64, precision=None,
                                    interpret: bool | None = None):
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
