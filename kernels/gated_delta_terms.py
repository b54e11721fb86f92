"""The gated delta rule's chunk-local terms in jnp, and the exact (I + L)^-1 that the kernels share.

`chunk_terms` is the reference's (`models.gated_delta.chunked_gated_delta_rule`) chunk-local maths, batched
over chunks, in the layout of kernels/gated_delta.py's backward kernels: the forward kernels compute the same
terms on the fly, and the backward recomputes them here and differentiates them with `jax.vjp`.
`unit_lower_inverse` is written with a matmul argument, so that the WY kernel (Triton dots) and `chunk_terms`
(batched jnp) invert by the same steps.

Shapes: B batch, Tp time (a multiple of C), Hk key heads, Hv value heads (R = Hv / Hk), Dk key dim, Dv value
dim, C chunk (64), N chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

CHUNK = 64


# ---- (I + L)^-1 ------------------------------------------------------------------------------------
def unit_lower_inverse(lmat, mm, block: int = 16):
    """(I + L)^-1 of strictly lower-triangular L [..., C, C], exactly: forward substitution written as matmuls
    (`mm`), for the kernels (Triton has no triangular solve) and for the jnp terms alike.

    A row-by-row substitution is C dependent steps. Instead: the inverse D of the block-diagonal part (blocks of
    16), by substitution on all blocks at once (rows i with i % 16 == s in step s: 15 matmuls), then block
    forward substitution for each later block row (X_a = D_aa - D_aa sum_{c<a} L_ac X_c: 2 matmuls a block),
    as FLA's `solve_tril` does. (A power series (I - L)(I + L^2)(I + L^4)... would be 2 log C matmuls, but
    sums terms that cancel: with L all ones below the diagonal they reach C(62, 31) ~ 5e17.)
    """
    c = lmat.shape[-1]
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
    row_block, row_in = lax.div(row, block), lax.rem(row, block)
    in_block = row_block == lax.div(col, block)
    diag = jnp.where(in_block, lmat, 0.0)
    x = jnp.broadcast_to(eye, lmat.shape)
    for s in range(1, min(block, c)):  # rows s, 16 + s, ...: they read only rows above them in their block
        x = jnp.where(row_in == s, eye - mm(diag, x), x)
    d, below = x, jnp.where(in_block, 0.0, lmat)
    for a in range(1, c // block):  # block row a reads the final rows of the blocks above it
        x = x - mm(d, mm(jnp.where(row_block == a, below, 0.0), x))
    return x


@jax.custom_vjp
def _tril_inverse(lmat):
    """(I + L)^-1 for strictly lower-triangular L [..., C, C] in jnp, with the inverse's own gradient
    (dL = -A^T dA A^T) rather than autodiff through the substitution's steps."""
    return unit_lower_inverse(lmat, jnp.matmul)


def _tril_inverse_fwd(lmat):
    a = _tril_inverse(lmat)
    return a, a


def _tril_inverse_bwd(a, da):
    at = jnp.swapaxes(a, -1, -2)
    return (-(at @ da @ at),)


_tril_inverse.defvjp(_tril_inverse_fwd, _tril_inverse_bwd)
tril_inverse = _tril_inverse  # models/gated_delta.py's chunked form uses it too


@jax.custom_vjp
def _known_inverse(lmat, a):
    """`a`, an (I + L)^-1 computed elsewhere (the WY kernel's), with the inverse's gradient in L."""
    del lmat
    return a


def _known_inverse_fwd(lmat, a):
    return a, a


def _known_inverse_bwd(a, da):
    return (*_tril_inverse_bwd(a, da), jnp.zeros_like(a))


_known_inverse.defvjp(_known_inverse_fwd, _known_inverse_bwd)


# ---- chunk-local terms (jnp) ------------------------------------------------------------------------
def chunk_terms(q, k, v, g, beta, seg, chunk: int = CHUNK, inverse=None):
    """The chunk-local terms of the WY form, in the scan kernels' layout (the reference's maths).

    Args:
      q, k: [B, Tp, Hk, Dk] (k zero on invalid tokens); v: [B, Tp, Hv, Dv]; g, beta: [B, Tp, Hv] (zero on
        invalid tokens); any float dtype, computed in fp32. Tp is a multiple of `chunk`.
      seg: [B, Tp] int32, resets so far in the token's chunk (up to and including it).
      inverse: [B, Hv, Tp, C] each chunk's (I + L)^-1 if known (the forward kernel's), else None (computed).
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
    # (jax.scipy.linalg.solve_triangular would do; but XLA:CPU's batched solves, run side by side on a small
    # machine, deadlocked jaxlib 0.10.2's thread pool in this backward.)
    lmat = jnp.where(strict, kk * decay * beta[..., :, None], 0.0)  # [B, Hk, R, N, C, C]
    if inverse is None:
        a = _tril_inverse(lmat)
    else:
        a = _known_inverse(lmat, inverse.astype(f32).reshape(b, hk, r, n, chunk, chunk))
    into = jnp.exp(cum) * carried  # [B, Hk, R, N, C]
    u = a @ (v * beta[..., None])
    w = a @ (k * (beta * into)[..., None])
    attn = qk * decay
    q_in = q * into[..., None]
    k_out = k * (jnp.exp(cum[..., -1:] - cum) * (seg == seg[..., -1:]))[..., None]
    keep = jnp.exp(cum[..., -1]) * carried[..., -1]  # [B, Hk, R, N]
    flat = lambda a: jnp.broadcast_to(a, (b, hk, r, *a.shape[3:])).reshape(b, hv, t, a.shape[-1])
    return flat(u), flat(w), flat(attn), flat(q_in), flat(k_out), keep.reshape(b, hv, n)
