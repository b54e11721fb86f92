"""One decode step of the gated delta rule, in the engine's state slots (Qwen3.5's linear layers).

**Why.** A Qwen3.5-9B decode step carries 24 layers x 32 heads of a [128, 128] recurrent state a sequence: 25 MB
a row in bf16, beside 18 GB of weights for the whole batch. XLA's gather of the rows' slots, the update and the
scatter back move each state three or four times; the step only needs to read it once and write it once.

**What.** `gdn_decode_step(state, slots, q, k, v, g, beta)` advances every row's state by one token and returns
the token's output and the rows' new states: for row r, head h, with S = state[slots[r], h] [Dk, Dv]:

    S  = exp(g) S;   S += k (beta (v - S^T k))^T;   o = S^T q

Each program reads its row's slot straight from the pool (no gathered copy), updates it in registers in fp32 and
writes it out, in one of two forms (`in_place`):

* False (`state_update='scatter'`): the rows' new states [S, Hv, Dk, Dv]; the caller scatters them into the
  slots. Four passes over a row's state a step (read, write the row, read it, write the
  slot).
* True (`state_update='in_place'`, the engine's default): the pool is the kernel's input aliased to its output,
  and each program writes its row's new state back into its slot: two passes. XLA must then give the kernel the
  pool's own buffer: in a while loop it does so only where nothing else reads the pool after the kernel (the decode
  step updates each layer's slots once and reads nothing of them after); an earlier form copied the whole pool
  there (24 GB at Qwen3.5-9B's state slots, benchmarks/NOTES.md item 48). On an H100 this form took the 9B's
  generation at 256 rows from 34.8 s (scatter) to 16.6 s (NOTES item 51).

Rows with slot 0 (finished or padding rows) sit in the scratch slot: their programs read and write nothing
(`SKIP_DEAD`), and their outputs are garbage the caller discards.

Pallas with the Triton lowering on GPU; interpret mode elsewhere (tests). Grid (row, value head, Dv block): a
program loads its row's slot from `slots` (the Triton backend has no scalar prefetch), the key head's q and k
(value head h reads key head h // (Hv / Hk)), its block of v, g and beta, and the [Dk, bv] block of the state.
On an H100 at the 9B's heads a whole [128, 128] head a program (8 warps) moves 2.40 TB/s at 545 rows, against
1.66 TB/s for the first form's [128, 32] blocks, whose 64-byte rows split the state's cache lines
(benchmarks/NOTES.md item 53).

Glossary: Ns state slots, S rows, Hk / Hv key / value heads, Dk / Dv their dims, bv the Dv block.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def supported(dk: int, dv: int) -> bool:
    """Whether the kernel takes these head dims (Triton blocks: powers of two >= 16)."""
    pow2 = lambda x: x >= 16 and x & (x - 1) == 0
    return pow2(dk) and pow2(dv)


def gdn_decode_step_reference(state, slots, q, k, v, g, beta, *, in_place: bool = False):
    """The same step in jnp (gather, update; in place: and the scatter into the slots). Args and returns as
    `gdn_decode_step`."""
    rep = v.shape[1] // q.shape[1]
    s = state[slots].astype(jnp.float32)  # [S, Hv, Dk, Dv]
    qf, kf = (jnp.repeat(x.astype(jnp.float32), rep, axis=1) for x in (q, k))  # [S, Hv, Dk]
    s = s * jnp.exp(g.astype(jnp.float32))[..., None, None]
    kv = jnp.einsum("shkv,shk->shv", s, kf)
    s = s + jnp.einsum("shk,shv->shkv", kf, (v.astype(jnp.float32) - kv) * beta.astype(jnp.float32)[..., None])
    o = jnp.einsum("shkv,shk->shv", s, qf)
    rows = s.astype(state.dtype)
    # only the scratch slot repeats among the rows' slots (as in every pool write: rollout/paged_decode.put)
    return o, (state.at[slots].set(rows, unique_indices=True) if in_place else rows)


def _kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, new_ref, *, rep, block_v, in_place,
            skip_dead):
    """One (row, value head, Dv block). slots_ref [S]; q_ref, k_ref [S, Hk, Dk]; v_ref, o_ref [S, Hv, Dv]; g_ref,
    beta_ref [S, Hv]; state_ref [Ns, Hv, Dk, Dv]; new_ref: the rows' new states [S, Hv, Dk, Dv], or in place the
    pool itself (aliased to state_ref, whose buffer it is: read and written through new_ref). `skip_dead`: a row
    in the scratch slot (slot 0) reads and writes nothing (its outputs are left unwritten)."""
    r, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[r]

    def step():
        kh = h // rep
        cols = pl.ds(j * block_v, block_v)
        q = pltriton.load(q_ref.at[r, kh, :]).astype(jnp.float32)  # [Dk]
        k = pltriton.load(k_ref.at[r, kh, :]).astype(jnp.float32)
        v = pltriton.load(v_ref.at[r, h, cols]).astype(jnp.float32)  # [bv]
        decay = jnp.exp(g_ref[r, h].astype(jnp.float32))
        beta = beta_ref[r, h].astype(jnp.float32)
        src = new_ref if in_place else state_ref
        s = pltriton.load(src.at[slot, h, :, cols]).astype(jnp.float32) * decay  # [Dk, bv]
        kv = jnp.sum(s * k[:, None], axis=0)  # [bv]
        s = s + k[:, None] * ((v - kv) * beta)[None, :]
        o = jnp.sum(s * q[:, None], axis=0)
        pltriton.store(new_ref.at[slot if in_place else r, h, :, cols], s.astype(new_ref.dtype))
        pltriton.store(o_ref.at[r, h, cols], o)

    if skip_dead:
        pl.when(slot != 0)(step)
    else:
        step()


# The launch shape, tuned on an H100 at Qwen3.5-9B's heads (benchmarks/diag/gdn_decode_tune.py; NOTES item 53):
# BLOCK_V value columns a program ([Dk, BLOCK_V] of the state), NUM_WARPS, and dead rows skipped. The environment's
# JAXRL_GDN_DECODE_FORM="block_v,num_warps,skip_dead" (e.g. "64,4,1") overrides it, for tuning runs.
BLOCK_V, NUM_WARPS, SKIP_DEAD = 128, 8, True
if os.environ.get("JAXRL_GDN_DECODE_FORM"):
    _form = os.environ["JAXRL_GDN_DECODE_FORM"].split(",")
    BLOCK_V, NUM_WARPS, SKIP_DEAD = int(_form[0]), int(_form[1]), bool(int(_form[2]))


@functools.partial(jax.jit, static_argnames=("interpret", "in_place", "block_v", "num_warps", "skip_dead"))
def _step(state, slots, q, k, v, g, beta, *, interpret: bool, in_place: bool, block_v: int | None = None,
          num_warps: int | None = None, skip_dead: bool | None = None):
    rows, hv, dv = v.shape
    dk = q.shape[-1]
    # a program's [Dk, bv] fp32 block stays at most the tuned [128, 128] (64 KB of registers over 8 warps)
    block_v = min(dv, block_v or BLOCK_V, max(16, 16384 // dk))
    kernel = functools.partial(_kernel, rep=hv // q.shape[1], block_v=block_v, in_place=in_place,
                               skip_dead=SKIP_DEAD if skip_dead is None else skip_dead)
    full = lambda x: pl.BlockSpec(block_shape=x.shape, index_map=lambda *_: (0,) * x.ndim)
    args = (slots.astype(jnp.int32), q, k, v, g, beta, state)
    new = jax.ShapeDtypeStruct(state.shape if in_place else (rows, hv, dk, dv), state.dtype)
    return pl.pallas_call(
        kernel,
        grid=(rows, hv, dv // block_v),
        in_specs=[full(x) for x in args],
        out_specs=[full(v), full(new)],
        out_shape=[jax.ShapeDtypeStruct((rows, hv, dv), jnp.float32), new],
        input_output_aliases={6: 1} if in_place else {},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="gdn_decode_step_in_place" if in_place else "gdn_decode_step",
    )(*args)


def gdn_decode_step(state, slots, q, k, v, g, beta, *, impl: str = "auto", in_place: bool = False):
    """One decode step of the gated delta rule for each row, in its state slot.

    Args:
      state: [Ns, Hv, Dk, Dv] the state slots (fp32 or bf16): read, and with `in_place` written (its buffer, where
        the caller gives it up, as a decode program carrying it does; else XLA copies it first).
      slots: [S] int32 each row's slot (0: the scratch slot; live rows' slots distinct).
      q, k: [S, Hk, Dk] (L2-normalised; q scaled by Dk^-0.5); v: [S, Hv, Dv]; g, beta: [S, Hv] (log decay and
        write strength).
      impl: 'pallas' (the kernel; interpreted off the GPU), 'xla' (`gdn_decode_step_reference`), or 'auto': the
        kernel on a GPU where `supported(Dk, Dv)`.
      in_place: write the new states into their slots (see the module docstring).
    Returns:
      o [S, Hv, Dv] fp32, and the rows' new states [S, Hv, Dk, Dv] in the slots' dtype (for
      `state.at[slots].set(...)`), or with `in_place` the state slots [Ns, Hv, Dk, Dv] holding them.
    """
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"gdn_decode_step impl={impl!r}: use 'auto', 'pallas' or 'xla'")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        impl = "pallas" if on_gpu and supported(q.shape[-1], v.shape[-1]) else "xla"
    if impl == "xla":
        return gdn_decode_step_reference(state, slots, q, k, v, g, beta, in_place=in_place)
    return _step(state, slots, q, k, v, g, beta, interpret=not on_gpu, in_place=in_place)
