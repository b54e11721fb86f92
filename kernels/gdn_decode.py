"""One decode step of the gated delta rule, in place in the engine's state slots (Qwen3.5's linear layers).

**Why.** A Qwen3.5-9B decode step carries 24 layers x 32 heads of a [128, 128] recurrent state a sequence: 25 MB
a row in bf16, beside 18 GB of weights for the whole batch. XLA's gather of the rows' slots, the update and the
scatter back move each state three or four times; the step only needs to read it once and write it once.

**What.** `gdn_decode_step(state, slots, q, k, v, g, beta)` advances every row's state by one token and returns
the token's output and the rows' new states: for row r, head h, with S = state[slots[r], h] [Dk, Dv]:

    S  = exp(g) S;   S += k (beta (v - S^T k))^T;   o = S^T q

Each program reads its row's slot straight from the pool (no gathered copy), updates it in registers in fp32 and
writes the row's new state [S, Hv, Dk, Dv]; the caller scatters those back into the slots (in place, in the
decode loop). Aliasing the pool itself to the kernel's output would save that write, but in a while loop XLA
copied the whole pool for it (24 GB a layer set at Qwen3.5-9B's state slots, out of memory on an H100). Rows
with slot 0 (finished or padding rows) read the scratch slot; their outputs are garbage the caller discards.

Pallas with the Triton lowering on GPU; interpret mode elsewhere (tests). Grid (row, value head, Dv block): a
program loads its row's slot from `slots` (the Triton backend has no scalar prefetch), the key head's q and k
(value head h reads key head h // (Hv / Hk)), its block of v, g and beta, and the [Dk, bv] block of the state.

Glossary: Ns state slots, S rows, Hk / Hv key / value heads, Dk / Dv their dims, bv the Dv block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def supported(dk: int, dv: int) -> bool:
    """Whether the kernel takes these head dims (Triton blocks: powers of two >= 16)."""
    pow2 = lambda x: x >= 16 and x & (x - 1) == 0
    return pow2(dk) and pow2(dv)


def gdn_decode_step_reference(state, slots, q, k, v, g, beta):
    """The same step in jnp (gather, update). Args and returns as `gdn_decode_step`."""
    rep = v.shape[1] // q.shape[1]
    s = state[slots].astype(jnp.float32)  # [S, Hv, Dk, Dv]
    qf, kf = (jnp.repeat(x.astype(jnp.float32), rep, axis=1) for x in (q, k))  # [S, Hv, Dk]
    s = s * jnp.exp(g.astype(jnp.float32))[..., None, None]
    kv = jnp.einsum("shkv,shk->shv", s, kf)
    s = s + jnp.einsum("shk,shv->shkv", kf, (v.astype(jnp.float32) - kv) * beta.astype(jnp.float32)[..., None])
    o = jnp.einsum("shkv,shk->shv", s, qf)
    return o, s.astype(state.dtype)


def _kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, rows_ref, *, rep, block_v):
    """One (row, value head, Dv block). slots_ref [S]; q_ref, k_ref [S, Hk, Dk]; v_ref, o_ref [S, Hv, Dv]; g_ref,
    beta_ref [S, Hv]; state_ref [Ns, Hv, Dk, Dv]; rows_ref [S, Hv, Dk, Dv]."""
    r, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[r]
    kh = h // rep
    cols = pl.ds(j * block_v, block_v)
    q = pltriton.load(q_ref.at[r, kh, :]).astype(jnp.float32)  # [Dk]
    k = pltriton.load(k_ref.at[r, kh, :]).astype(jnp.float32)
    v = pltriton.load(v_ref.at[r, h, cols]).astype(jnp.float32)  # [bv]
    decay = jnp.exp(g_ref[r, h].astype(jnp.float32))
    beta = beta_ref[r, h].astype(jnp.float32)
    s = pltriton.load(state_ref.at[slot, h, :, cols]).astype(jnp.float32) * decay  # [Dk, bv]
    kv = jnp.sum(s * k[:, None], axis=0)  # [bv]
    s = s + k[:, None] * ((v - kv) * beta)[None, :]
    o = jnp.sum(s * q[:, None], axis=0)
    pltriton.store(rows_ref.at[r, h, :, cols], s.astype(rows_ref.dtype))
    pltriton.store(o_ref.at[r, h, cols], o)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _step(state, slots, q, k, v, g, beta, *, interpret: bool):
    rows, hv, dv = v.shape
    dk = q.shape[-1]
    block_v = min(dv, max(16, 4096 // dk))  # a [Dk, bv] fp32 block of about 16 KB
    kernel = functools.partial(_kernel, rep=hv // q.shape[1], block_v=block_v)
    full = lambda x: pl.BlockSpec(block_shape=x.shape, index_map=lambda *_: (0,) * x.ndim)
    args = (slots.astype(jnp.int32), q, k, v, g, beta, state)
    new = jax.ShapeDtypeStruct((rows, hv, dk, dv), state.dtype)
    return pl.pallas_call(
        kernel,
        grid=(rows, hv, dv // block_v),
        in_specs=[full(x) for x in args],
        out_specs=[full(v), full(new)],
        out_shape=[jax.ShapeDtypeStruct((rows, hv, dv), jnp.float32), new],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_decode_step",
    )(*args)


def gdn_decode_step(state, slots, q, k, v, g, beta, *, impl: str = "auto"):
    """One decode step of the gated delta rule for each row, in its state slot.

    Args:
      state: [Ns, Hv, Dk, Dv] the state slots (fp32 or bf16), read, not written.
      slots: [S] int32 each row's slot (0: the scratch slot).
      q, k: [S, Hk, Dk] (L2-normalised; q scaled by Dk^-0.5); v: [S, Hv, Dv]; g, beta: [S, Hv] (log decay and
        write strength).
      impl: 'pallas' (the kernel; interpreted off the GPU), 'xla' (`gdn_decode_step_reference`), or 'auto': the
        kernel on a GPU where `supported(Dk, Dv)`.
    Returns:
      o [S, Hv, Dv] fp32, and the rows' new states [S, Hv, Dk, Dv] in the slots' dtype (for
      `state.at[slots].set(...)`).
    """
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"gdn_decode_step impl={impl!r}: use 'auto', 'pallas' or 'xla'")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        impl = "pallas" if on_gpu and supported(q.shape[-1], v.shape[-1]) else "xla"
    if impl == "xla":
        return gdn_decode_step_reference(state, slots, q, k, v, g, beta)
    return _step(state, slots, q, k, v, g, beta, interpret=not on_gpu)
