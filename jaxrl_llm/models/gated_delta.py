"""The gated delta rule (Gated DeltaNet, the linear attention of Qwen3.5): recurrent and chunked forms.

A linear-attention head keeps a state S [Dk, Dv]. Token t decays it by exp(g_t) (g_t <= 0), then writes
v_t at key k_t with strength beta_t, replacing what S held at k_t (the delta rule), and reads it at q_t:

    S   = exp(g_t) * S
    S  += k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

`recurrent_gated_delta_rule` runs that loop (the decode step, and the reference). `chunked_gated_delta_rule`
computes the same numbers in chunks of C tokens (arXiv 2412.06464, the WY form of DeltaNet): inside a chunk
every pairwise term is one batched matmul and the unit-lower-triangular system (I + L) X = R is solved once;
only the [Dk, Dv] state crosses chunks, in a `lax.scan`. Memory is O(T C) a head, not O(T^2), and autodiff
through it is the training pass's backward. On GPUs `kernels/gated_delta.py` replaces it where it can.

Two things beyond HF's `torch_chunk_gated_delta_rule`:
  * `resets` [B, T]: the state is zeroed before token t. Packed micro-batches set it at every row's first
    token, so several rows share one sequence without seeing each other (inside a chunk, pairs across a
    reset are masked; the state carried into a chunk reaches only the tokens before its first reset).
  * `valid` [B, T]: an invalid token (padding) leaves the state untouched (g = 0, beta = 0, k = 0), so the
    final state of a right-padded row is the state after its last real token, which the engine keeps.

Inputs are q and k already L2-normalised (q also scaled by Dk^-0.5), in any float dtype; the maths runs in
fp32 and outputs are fp32. q and k may have fewer heads than v (Qwen3.5: 16 key heads, 32 value heads):
value head h reads key head h // (Hv / Hk), as transformers' `repeat_interleave` does.

Shapes: B batch, T time, Hk key heads, Hv value heads, Dk key dim, Dv value dim, C chunk, N chunks,
K conv kernel width, E conv channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 32  # FLA uses 64 on GPUs (the kernel picks its own); 32 runs the XLA form 5x faster on CPUs


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in fp32 (transformers' and FLA's `l2norm`)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _expand_heads(x: jax.Array, hv: int) -> jax.Array:
    """[B, T, Hk, D] -> [B, T, Hv, D], value head h reading key head h // (Hv / Hk)."""
    hk = x.shape[2]
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    return x if hk == hv else jnp.repeat(x, hv // hk, axis=2)


def _prepare(q, k, v, g, beta, valid):
    """fp32 inputs with value-head-many q/k heads, and invalid tokens made identity steps."""
    hv = v.shape[2]
    q, k = _expand_heads(q, hv).astype(jnp.float32), _expand_heads(k, hv).astype(jnp.float32)
    v, g, beta = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
    if valid is not None:
        keep = valid.astype(bool)
        g = jnp.where(keep[..., None], g, 0.0)
        beta = jnp.where(keep[..., None], beta, 0.0)
        k = jnp.where(keep[..., None, None], k, 0.0)
    return q, k, v, g, beta


def _zero_state(b, hv, dk, dv):
    return jnp.zeros((b, hv, dk, dv), jnp.float32)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, resets=None, valid=None):
    """The token-by-token form.

    Args:
      q, k: [B, T, Hk, Dk] (normalised; q scaled); v: [B, T, Hv, Dv]; g, beta: [B, T, Hv].
      initial_state: [B, Hv, Dk, Dv] or None (zeros).
      resets: [B, T] bool or None: zero the state before token t.
      valid: [B, T] bool or None: invalid tokens leave the state as it is.
    Returns:
      o [B, T, Hv, Dv] fp32, final state [B, Hv, Dk, Dv] fp32.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid)
    b, t, hv, dk = k.shape
    dv = v.shape[-1]
    state = _zero_state(b, hv, dk, dv) if initial_state is None else initial_state.astype(jnp.float32)
    resets = jnp.zeros((b, t), bool) if resets is None else resets.astype(bool)

    def step(s, xs):
        qt, kt, vt, gt, bt, rt = xs  # [B, Hv, Dk], [B, Hv, Dk], [B, Hv, Dv], [B, Hv], [B, Hv], [B]
        s = jnp.where(rt[:, None, None, None], 0.0, s) * jnp.exp(gt)[..., None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", s, kt)
        s = s + jnp.einsum("bhk,bhv->bhkv", kt, (vt - kv) * bt[..., None])
        return s, jnp.einsum("bhkv,bhk->bhv", s, qt)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, resets))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def chunked_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, resets=None, valid=None,
                             chunk: int = CHUNK):
    """The chunked form: the same outputs and final state as `recurrent_gated_delta_rule`.

    Args and returns as `recurrent_gated_delta_rule`; `chunk` is C (T is padded to a multiple of it with
    identity steps).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid)
    b, t, hv, dk = k.shape
    dv = v.shape[-1]
    resets = jnp.zeros((b, t), bool) if resets is None else resets.astype(bool)
    pad = -t % chunk
    if pad:  # identity steps: g = beta = k = 0 (q and v are free; zeros)
        zpad = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        q, k, v, g, beta, resets = map(zpad, (q, k, v, g, beta, resets))
    n = (t + pad) // chunk
    # [B, Hv, N, C, ...]
    heads = lambda a: jnp.moveaxis(a, 2, 1).reshape(b, hv, n, chunk, *a.shape[3:])
    q, k, v, g, beta = map(heads, (q, k, v, g, beta))
    seg = jnp.cumsum(resets.reshape(b, 1, n, chunk).astype(jnp.int32), axis=-1)  # resets so far in the chunk
    carried = seg == 0  # [B, 1, N, C]: the token still sees the state carried into the chunk
    same = seg[..., :, None] == seg[..., None, :]  # [B, 1, N, C, C]: no reset in (j, i]
    idx = jnp.arange(chunk)
    lower = (idx[:, None] >= idx[None, :]) & same  # j <= i, same row
    strict = (idx[:, None] > idx[None, :]) & same  # j < i, same row

    cum = jnp.cumsum(g, axis=-1)  # [B, Hv, N, C] log decay from the chunk start through token i
    diff = cum[..., :, None] - cum[..., None, :]  # decay from token j to token i
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # [B, Hv, N, C, C]
    kb, vb = k * beta[..., None], v * beta[..., None]
    lmat = jnp.where(strict, jnp.einsum("...ik,...jk->...ij", kb, k) * decay, 0.0)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    system = eye + lmat  # unit lower triangular
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
    u = solve(vb)  # [B, Hv, N, C, Dv]: the values the chunk writes, before the carried state's part
    w = solve(kb * (jnp.exp(cum) * carried)[..., None])  # [B, Hv, N, C, Dk]: how the carried state enters u
    attn = jnp.einsum("...ik,...jk->...ij", q, k) * decay  # [B, Hv, N, C, C] (diagonal included)
    q_in = q * (jnp.exp(cum) * carried)[..., None]  # reads of the carried state
    last = seg[..., -1:]  # the chunk's last token's reset count
    k_out = k * (jnp.exp(cum[..., -1:] - cum) * (seg == last))[..., None]  # writes that reach the chunk's end
    keep = jnp.exp(cum[..., -1]) * carried[..., -1]  # [B, Hv, N]: what is left of the carried state

    def step(s, xs):
        u_c, w_c, attn_c, q_c, k_c, keep_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, s)
        o_c = jnp.einsum("bhck,bhkv->bhcv", q_c, s) + jnp.einsum("bhij,bhjv->bhiv", attn_c, v_new)
        s = s * keep_c[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new)
        return s, o_c

    state = _zero_state(b, hv, dk, dv) if initial_state is None else initial_state.astype(jnp.float32)
    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (u, w, attn, q_in, k_out, keep))
    state, o = jax.lax.scan(step, state, xs)  # o [N, B, Hv, C, Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, hv, n * chunk, dv)[:, :, :t]
    return jnp.moveaxis(o, 1, 2), state


def causal_conv1d(x: jax.Array, weight: jax.Array, *, initial=None, resets=None, valid=None):
    """Depthwise causal convolution over time, then SiLU (the Gated DeltaNet's short convolution).

    out_t = silu(sum_s weight[K-1-s] * x_{t-s}), where x_{t-s} is the earlier input of the same row (zero
    before the row's start, or taken from `initial` for positions before this call).

    Args:
      x: [B, T, E]; weight: [K, E] (HF's conv1d.weight [E, 1, K], transposed).
      initial: [B, K-1, E] the inputs before x (the conv state), or None (zeros).
      resets: [B, T] bool: a row starts at token t (nothing before it is seen).
      valid: [B, T] bool: invalid tokens' inputs are zeros (transformers zeroes padding's hidden states).
    Returns:
      out [B, T, E] in x's dtype, and the K-1 last inputs [B, K-1, E] (the conv state after x; with `valid`,
      after each row's last valid token: rows are right-padded).
    """
    b, t, e = x.shape
    kw = weight.shape[0]
    if valid is not None:
        x = jnp.where(valid[..., None], x, 0)
    prev = jnp.zeros((b, kw - 1, e), x.dtype) if initial is None else initial.astype(x.dtype)
    xp = jnp.concatenate([prev, x], axis=1)  # [B, K-1+T, E]
    # seen[b, t, s]: input t - s belongs to token t's row (no reset in (t - s, t])
    if resets is not None:
        r = jnp.cumsum(resets.astype(jnp.int32), axis=1)
        rp = jnp.concatenate([jnp.zeros((b, kw - 1), jnp.int32), r], axis=1)
    acc = jnp.zeros((b, t, e), jnp.float32)
    for s in range(kw):  # K is 4: a few shifted multiply-adds
        xs = xp[:, kw - 1 - s: kw - 1 - s + t].astype(jnp.float32)
        if resets is not None and s:
            xs = jnp.where((rp[:, kw - 1 - s: kw - 1 - s + t] == r)[..., None], xs, 0.0)
        acc = acc + xs * weight[kw - 1 - s].astype(jnp.float32)
    out = jax.nn.silu(acc).astype(x.dtype)
    if valid is None:
        state = xp[:, t:]
    else:  # the K-1 inputs before position `length` of each row
        length = jnp.sum(valid.astype(jnp.int32), axis=1)
        state = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, kw - 1, axis=0))(xp, length)
    return out, state


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, resets=None, valid=None, impl: str = "auto"):
    """The chunked form through the fastest implementation available: the Pallas kernel on GPUs
    (kernels/gated_delta.py, where its shapes allow), else `chunked_gated_delta_rule`. Args as there."""
    if impl != "xla":
        try:
            from kernels.gated_delta import chunked_gated_delta_rule_kernel, kernel_supported
        except ImportError:  # the kernel is optional
            kernel_supported = None
        if kernel_supported is not None and kernel_supported(q, k, v, impl=impl):
            return chunked_gated_delta_rule_kernel(q, k, v, g, beta, initial_state=initial_state, resets=resets,
                                                   valid=valid)
    return chunked_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, resets=resets, valid=valid)
