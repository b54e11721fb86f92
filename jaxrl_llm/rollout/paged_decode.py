"""Prefill and decode over a paged KV pool, as pure functions of engine params (the paged sampler's device side).

The pool is, per layer, K and V of shape [K, P, ps, H]: P pages of ps token slots. A row's position p
lives in page tables[row, p // ps] at offset p % ps; the host (rollout/scheduler.py) owns the tables.
Nothing here allocates, grows or copies a cache: a prefill chunk scatters its K/V into the row's pages,
and a decode step scatters one token a row, then attends through the block table (the Pallas kernel
in kernels/paged_attention.py, or an XLA gather of the table's pages).

The decoder layer, the fused engine weights and the sampling are the dense sampler's
(rollout/decode.py), so both engines compute the same tokens and log-probs.

Qwen3.5's linear-attention layers keep no pages: their entry in the pool is a pair of *state slots*, the conv
window [Ns, K-1, E] and the recurrent state [Ns, Hv, Dk, Dv] of Ns sequences. A running row holds one slot (the
host's scheduler hands them out beside pages); a prefill chunk starts from its row's slot (zeros at position
0), runs the chunked gated delta rule over its tokens and writes the state after its last real token back, and
to a prompt's snapshot slot when it is the prompt's first sample (its siblings copy that at the fork, with
the copy program); a decode step reads, advances and writes each live row's slot: the kernel writes the rows' new
states and XLA scatters them into the slots (`state_update='scatter'`), or the kernel writes each slot in the
pool's buffer, aliased to its output (`'in_place'`, the default: 2 passes over a state, not 4;
kernels/gdn_decode.py). Either way each layer's slots are updated once a step and nothing reads them after, so XLA
can update the donated pool where it lies.

Glossary: S decode slots, B prefill rows, L prefill chunk length, W table width (pages), P pages,
ps page size, K kv heads, N q heads, G = N // K, H head dim, D model, V vocab; Ns state slots, E conv channels,
Hv value heads, Dk/Dv key/value head dims.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Pspec

from jaxrl_llm import sharding
from jaxrl_llm.models.gated_delta import causal_conv1d, gated_delta_rule
from jaxrl_llm.models.qwen2 import _MASK_VALUE
from jaxrl_llm.models.rope import rope_cos_sin
from jaxrl_llm.rollout.decode import (
    DecodeSpec,
    _final_logits,
    _is_stop,
    _layer,
    layer_params,
    split_mixed,
    stack_routing,
)
from jaxrl_llm.rollout.sampling import sample_next, token_logprobs

# [K, P, ps, H]: kv heads over "tensor", pages over the data-parallel axes (each shard owns a page range;
# page ids in tables are local to the shard, and the pool ops below run per shard)
POOL_AXES = ("act_kv_heads", "batch", None, None)
# kernels/gdn_decode.py's `impl` for the decode step of the linear layers: "auto" (the Pallas kernel on a GPU, the
# jnp form elsewhere); tests set "pallas" to run the kernel in Pallas' interpreter on the CPU.
GDN_DECODE_IMPL = "auto"


def state_shapes(spec: DecodeSpec, slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A linear layer's state slots: the conv window [Ns, K-1, E] and the recurrent state [Ns, Hv, Dk, Dv]."""
    return ((slots, spec.conv_kernel - 1, spec.conv_dim),
            (slots, spec.linear_value_heads, spec.linear_key_dim, spec.linear_value_dim))


def alloc_pool(num_pages: int, page_size: int, spec: DecodeSpec, dtype, state_slots: int = 0):
    """Zeroed pools: per layer (k, v) [K, P, ps, H] (zeros: a page never written holds finite values), or a
    linear layer's (conv, state) slots (`state_shapes`; the recurrent state in `spec.state_dtype`)."""
    shape = (spec.num_kv_heads, num_pages, page_size, spec.head_dim)
    z = lambda: sharding.constrain(jnp.zeros(shape, dtype), POOL_AXES)
    conv, rec = state_shapes(spec, state_slots)
    slots = lambda: (jnp.zeros(conv, dtype), jnp.zeros(rec, jnp.dtype(spec.state_dtype)))
    return [slots() if i in spec.linear_layers else (z(), z()) for i in range(spec.num_layers)]


def is_state(entry) -> bool:
    """Whether a pool entry is a linear layer's state slots (a 3-D conv window) rather than K/V pages."""
    return entry[0].ndim == 3


def page_size(pool) -> int:
    """ps of a pool: its first attention layer's pages [K, P, ps, H]."""
    return next(entry for entry in pool if not is_state(entry))[0].shape[2]


def put(x, index, value):
    """x.at[index].set(value), for every write into the pool: K/V pages, conv windows and recurrent-state slots.

    In every such write only the scratch entry (page or slot 0) can repeat: finished rows, padding tokens, padding
    rows, rows without a snapshot and unused copy pairs all write there, and nothing reads what lands there. Live
    rows own their pages and slots. So the indices are taken as unique: XLA's GPU scatter otherwise serialises the
    writes (a Qwen3.5-9B conv window's write went from 0.93 to 0.031 ms a layer, BENCHMARKS.md)."""
    return x.at[index].set(value, unique_indices=True)


def copy_pages(pool, src, dst, state_src=None, state_dst=None):
    """pool[:, dst] = pool[:, src] in every attention layer (copy on write), per shard, and the state slots
    state_dst = state_src in every linear layer (a prompt's snapshot into its siblings' slots).

    Each linear layer's copy waits for the previous one's (an optimization barrier): else nothing orders them, and
    every layer's gathered rows can be alive at once (24 x 1 GiB at Qwen3.5-9B's 1,024 pairs, out of memory on an
    H100). XLA's GPU pipeline keeps the barrier through scheduling; its CPU pipeline drops it before (there the
    layers' copies stay unordered).

    src, dst: [shards, C] int32 page ids local to each shard (unused pairs are (0, 0): the scratch page);
    state_src, state_dst: [C] int32 state slots (unused pairs (0, 0)).
    """
    def local(k, v, s, d):
        s, d = s[0], d[0]
        return put(k, (slice(None), d), k[:, s]), put(v, (slice(None), d), v[:, s])

    def states(conv, rec, after):
        if after is not None:
            conv, rec, _ = jax.lax.optimization_barrier((conv, rec, after))
        return put(conv, state_dst, conv[state_src]), put(rec, state_dst, rec[state_src])

    out, after = [], None
    for entry in pool:
        if is_state(entry):
            entry = after = states(*entry, after)
        else:
            entry = _per_shard(local, (*entry, src, dst), ("pool", "pool", "rows", "rows"), ("pool", "pool"))
        out.append(entry)
    return out


def _per_shard(fn, args, kinds, out_kinds):
    """Runs `fn` on each device's shard (all mesh axes manual) under a mesh of several devices, else directly.

    kinds name each argument's layout: "pool" [K, P, ps, H]; "heads" [S, T, N or K, H]; "rows" [S, ...]
    (rows over the data axes, the rest whole).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return fn(*args)
    pool_spec = None

    def spec(kind, x):
        nonlocal pool_spec
        if kind == "pool":
            pool_spec = sharding.logical_to_spec(POOL_AXES, x.shape, mesh)
            return pool_spec
        rows = sharding.logical_to_spec(("batch",), x.shape[:1], mesh)[0]
        if kind == "heads":
            return Pspec(rows, None, None, None)  # filled in below once the pool's head axis is known
        return Pspec(rows, *([None] * (x.ndim - 1)))

    in_specs = [spec(k, a) for k, a in zip(kinds, args)]
    heads = pool_spec[0] if pool_spec is not None else None
    in_specs = [Pspec(sp[0], None, heads, None) if k == "heads" else sp for k, sp in zip(kinds, in_specs)]
    outs = {"pool": pool_spec, "heads": Pspec(in_specs[0][0], None, heads, None)}
    out_specs = tuple(outs[k] for k in out_kinds) if isinstance(out_kinds, tuple) else outs[out_kinds]
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)(*args)


def _write(pages, new, page, off):
    """Scatters new [B, T, K, H] into pages [K, P, ps, H] at (page, off) [B, T] (`put`)."""
    return put(pages, (slice(None), page, off), new.transpose(2, 0, 1, 3).astype(pages.dtype))


def _gather(pages, tables):
    """pages [K, P, ps, H], tables [B, W] -> the rows' slots [B, K, W ps, H] in position order."""
    k, _, ps, h = pages.shape
    b, w = tables.shape
    g = pages[:, tables]  # [K, B, W, ps, H]
    return g.transpose(1, 0, 2, 3, 4).reshape(b, k, w * ps, h)


def _attend(q, kg, vg, mask):
    """q [B, T, N, H] against gathered K/V [B, K, C, H] under mask [B, T, C] -> [B, T, N, H]."""
    b, t, n, h = q.shape
    kh = kg.shape[1]
    qg = q.reshape(b, t, kh, n // kh, h)
    s = jnp.einsum("btkgh,bkch->bkgtc", qg, kg.astype(q.dtype), preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None], s * (h ** -0.5), _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgtc,bkch->btkgh", p, vg.astype(q.dtype))
    return out.reshape(b, t, n, h)


# A prefill's linear layer reads its rows' states from the slots once the layer's input exists (an optimization
# barrier). Nothing else orders a layer's gather after the layers before it, and the gathers depend on the pool alone:
# XLA may gather every layer's rows at the start, each an fp32 state a row, all alive at once (benchmarks/diag/
# prefill_memory.py compares the two on a GPU; XLA's CPU pipeline drops the barrier).
ORDER_SLOT_READS = True


def prefill_chunk(eparams, pool, ids, tables, start, length, scratch, slot=None, snap=None, *, spec: DecodeSpec):
    """Writes the K/V of a chunk of each row's context into its pages (and a linear layer's state into its slot).

    Row b's tokens ids[b, :length[b]] sit at positions start[b] .. start[b] + length[b] - 1; they attend
    to every earlier position of the row (pages written by earlier chunks, or shared prompt pages) and
    causally to each other. No logits: the last context token is fed by the first decode step.

    Args:
      pool: per layer (k, v) [K, P, ps, H], or a linear layer's state slots (donated by the caller's jit).
      ids: [B, L] int32; tables: [B, Wc] int32 covering positions < start + length.
      start, length, scratch: [B] int32 (scratch: the page that padding tokens write into).
      slot, snap: [B] int32 the rows' state slots and the snapshot slots their final state is also written to
        (0: the scratch slot); linear layers only.
    Returns:
      the pool, and (`spec.record_routing`) the chunk tokens' experts [B, L, L_moe, k] int32 (else None).
    """
    b, length_ = ids.shape
    ps = page_size(pool)
    wc = tables.shape[1]
    offs = jnp.arange(length_, dtype=jnp.int32)
    positions = start[:, None] + offs[None, :]  # [B, L]
    real = offs[None, :] < length[:, None]
    page = jnp.take_along_axis(tables, jnp.clip(positions // ps, 0, wc - 1), axis=1)
    page = jnp.where(real, page, scratch[:, None])
    off = positions % ps
    key_pos = jnp.arange(wc * ps, dtype=jnp.int32)
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & real[:, :, None]  # [B, L, Wc ps]
    cos, sin = rope_cos_sin(positions, spec.inv_freq())
    x = jnp.take(eparams["embed"], ids, axis=0)
    new, experts = [], []
    for i, (kp, vp) in enumerate(pool):
        lp = layer_params(eparams, i, spec)

        def attend(q, k, v, kp=kp, vp=vp):
            def local(q, k, v, kp, vp, tables, page, off, mask):
                kp, vp = _write(kp, k, page, off), _write(vp, v, page, off)
                return _attend(q, _gather(kp, tables), _gather(vp, tables), mask), kp, vp

            out, kp, vp = _per_shard(local, (q, k, v, kp, vp, tables, page, off, mask),
                                     ("heads", "heads", "heads", "pool", "pool", "rows", "rows", "rows", "rows"),
                                     ("heads", "pool", "pool"))
            return out, (kp, vp)

        def recur(mixed, g, beta, conv_w, conv=kp, rec=vp):
            if ORDER_SLOT_READS:  # see the constant
                mixed, conv, rec = jax.lax.optimization_barrier((mixed, conv, rec))
            fresh = start == 0  # a row's first chunk starts from zeros; a later one from its slot
            conv0 = jnp.where(fresh[:, None, None], 0, conv[slot]).astype(mixed.dtype)
            rec0 = jnp.where(fresh[:, None, None, None], 0, rec[slot].astype(jnp.float32))
            mixed, conv1 = causal_conv1d(mixed, conv_w, initial=conv0, valid=real)
            q, k, v = split_mixed(mixed, spec)
            o, rec1 = gated_delta_rule(q, k, v, g, beta, initial_state=rec0, valid=real)
            conv1, rec1 = conv1.astype(conv.dtype), rec1.astype(rec.dtype)
            # the next layer waits for the slots' update (see the decode step)
            o, conv, rec = jax.lax.optimization_barrier(
                (o, put(put(conv, slot, conv1), snap, conv1), put(put(rec, slot, rec1), snap, rec1)))
            return o, (conv, rec)

        x, kv, ex = _layer(lp, x, cos, sin, attend, spec, recur)
        new.append(kv)
        experts.append(ex)
    return new, (stack_routing(experts) if spec.record_routing else None)


def _decode_step(rec, slot, q, k, v, g, beta, *, in_place: bool = False):
    """kernels/gdn_decode.py's step of the rows' recurrent states, read from their slots: (outputs, new states), or
    in place (outputs, the slots); on a shard of several devices (the states are whole on each) every device runs
    it on its own copy."""
    from kernels.gdn_decode import gdn_decode_step  # the repo's kernels/

    step = functools.partial(gdn_decode_step, impl=GDN_DECODE_IMPL, in_place=in_place)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return step(rec, slot, q, k, v, g, beta)
    whole = Pspec()
    return jax.shard_map(step, mesh=mesh, in_specs=(whole,) * 7, out_specs=(whole, whole),
                         check_vma=False)(rec, slot, q, k, v, g, beta)


def _sample_rows(logits, row_keys, t, spec: DecodeSpec):
    """One token per row; row r draws from fold_in(row_keys[r], t[r]) (the dense sampler's stream)."""
    keys = jax.vmap(jax.random.fold_in)(row_keys, t)
    draw = lambda k, lg: sample_next(lg[None], k, temperature=spec.temperature, top_k=spec.top_k,
                                     top_p=spec.top_p)[0]
    return jax.vmap(draw)(keys, logits)


def decode_segment(eparams, pool, tables, pos, last, t, row_max, active, rids, scratch, key, seg_len, stop_free,
                   slots=None, *, spec: DecodeSpec, max_seg: int):
    """Decodes up to `seg_len` steps for every active slot, or until `stop_free` slots are free.

    A step feeds each slot's pending token (writing its K/V at `pos`) and samples token `t`.

    Args:
      pool: list of (k, v) [K, P, ps, H] (donated).
      tables: [S, W] int32 block tables; pos, last, t, row_max: [S] int32; active: [S] bool;
      rids: [S] int32 response ids (seed each row's stream); scratch: [S] int32 the slot's scratch page;
      key: the request's PRNG key, or [S] keys (each row its request's); seg_len, stop_free: int32 scalars
        (seg_len <= max_seg); slots: [S] int32 the rows' state slots (linear layers only).
    Returns:
      (pool, out) with out = dict(tokens [S, max_seg], logps [S, max_seg], count [S], active [S], steps),
      and (`spec.record_routing`) routing [S, max_seg, L_moe, k]: step j's fed token's experts.
    """
    s = tables.shape[0]
    ps = page_size(pool)
    w = tables.shape[1]
    row_keys = jax.vmap(jax.random.fold_in, (None if key.ndim == 0 else 0, 0))(key, rids)
    key_pos = jnp.arange(w * ps, dtype=jnp.int32)

    def cond(c):
        st, _ = c
        free = jnp.sum(~st["active"])
        return (st["step"] < seg_len) & jnp.any(st["active"]) & (free < stop_free)

    def body(c):
        st, pl = c
        act = st["active"]
        p = st["pos"]
        page = jnp.where(act, jnp.take_along_axis(tables, jnp.clip(p // ps, 0, w - 1)[:, None], axis=1)[:, 0],
                         scratch)[:, None]  # [S, 1]
        off = (p % ps)[:, None]
        cos, sin = rope_cos_sin(p[:, None], spec.inv_freq())
        lengths = jnp.where(act, p + 1, 0)
        mask = (key_pos[None, None, :] <= p[:, None, None]) & act[:, None, None]  # [S, 1, W ps]
        x = jnp.take(eparams["embed"], st["last"][:, None], axis=0)  # [S, 1, D]
        new, experts = [], []
        for i, (kp, vp) in enumerate(pl):
            lp = layer_params(eparams, i, spec)

            def attend(q, k, v, kp=kp, vp=vp):
                def local(q, k, v, kp, vp, tables, page, off, mask, lengths):
                    kp, vp = _write(kp, k, page, off), _write(vp, v, page, off)
                    if spec.attention == "pallas":
                        from kernels.paged_attention import paged_decode_attention  # the repo's kernels/

                        return paged_decode_attention(q[:, 0], kp, vp, tables, lengths)[:, None], kp, vp
                    return _attend(q, _gather(kp, tables), _gather(vp, tables), mask), kp, vp

                out, kp, vp = _per_shard(local, (q, k, v, kp, vp, tables, page, off, mask, lengths),
                                         ("heads", "heads", "heads", "pool", "pool", "rows", "rows", "rows", "rows",
                                          "rows"), ("heads", "pool", "pool"))
                return out, (kp, vp)

            def recur(mixed, g, beta, conv_w, conv=kp, rec=vp):
                slot = jnp.where(act, slots, 0)  # a finished row's step writes the scratch slot
                mixed, conv1 = causal_conv1d(mixed, conv_w, initial=conv[slot].astype(mixed.dtype))
                q, k, v = split_mixed(mixed, spec)  # [S, 1, heads, dim]
                in_place = spec.state_update == "in_place"  # the kernel writes the slots (else the rows' states)
                o, rows = _decode_step(rec, slot, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], in_place=in_place)
                # The layer's output waits for its slots' update: else XLA may schedule every layer's scatter
                # at the end of the step, each layer's new rows alive until then (24 GB at Qwen3.5-9B).
                conv = put(conv, slot, conv1.astype(conv.dtype))
                o, conv, rec = jax.lax.optimization_barrier((o, conv, rows if in_place else put(rec, slot, rows)))
                return o[:, None], (conv, rec)

            x, kv, ex = _layer(lp, x, cos, sin, attend, spec, recur)
            new.append(kv)
            experts.append(ex)
        logits = _final_logits(eparams, x[:, 0], spec)  # [S, V]
        tok = _sample_rows(logits, row_keys, st["t"], spec)
        logp = token_logprobs(logits, tok, temperature=spec.temperature)
        tok = jnp.where(act, tok, spec.pad_id)
        logp = jnp.where(act, logp, 0.0)
        stop = _is_stop(tok, spec.stop_ids) | (st["t"] + 1 >= row_max)
        inc = act.astype(jnp.int32)
        st = dict(step=st["step"] + 1, active=act & ~stop, pos=p + inc, t=st["t"] + inc,
                  last=jnp.where(act, tok, st["last"]), count=st["count"] + inc,
                  tokens=jax.lax.dynamic_update_index_in_dim(st["tokens"], tok, st["step"], axis=1),
                  logps=jax.lax.dynamic_update_index_in_dim(st["logps"], logp, st["step"], axis=1))
        if spec.record_routing:
            st["routing"] = jax.lax.dynamic_update_index_in_dim(
                c[0]["routing"], stack_routing(experts)[:, 0], c[0]["step"], axis=1)
        return st, new

    st = dict(step=jnp.asarray(0, jnp.int32), active=active, pos=pos, t=t, last=last,
              count=jnp.zeros((s,), jnp.int32), tokens=jnp.full((s, max_seg), spec.pad_id, jnp.int32),
              logps=jnp.zeros((s, max_seg), jnp.float32))
    if spec.record_routing:
        st["routing"] = jnp.full((s, max_seg, spec.num_moe_layers, spec.moe_top_k), -1, jnp.int32)
    st, pool = jax.lax.while_loop(cond, body, (st, list(pool)))
    out = dict(tokens=st["tokens"], logps=st["logps"], count=st["count"], active=st["active"], steps=st["step"])
    if spec.record_routing:
        out["routing"] = st["routing"]
    return pool, out


# ---- packed inputs: one host-to-device copy a call ---------------------------------------------------------
# A decode segment's inputs, [S, W + DECODE_COLS] int32: each slot's block table, then its position, pending token,
# tokens so far, budget, active flag and stream; the segment's length and its stop rule (repeated down their two
# columns); each row's request's PRNG key data (two uint32 words, bit-cast), so rows of several requests
# (a stream's steps, each with its seed) share a segment; and its state slot (linear layers).
DECODE_COLS = 11


def decode_packed(eparams, pool, packed, *, spec: DecodeSpec, max_seg: int):
    """`decode_segment` on the packed inputs of one shard (see DECODE_COLS)."""
    w = packed.shape[1] - DECODE_COLS
    col = lambda i: packed[:, w + i]
    keys = jax.random.wrap_key_data(jax.lax.bitcast_convert_type(packed[:, w + 8: w + 10], jnp.uint32))  # [S]
    return decode_segment(eparams, pool, packed[:, :w], col(0), col(1), col(2), col(3), col(4) > 0, col(5),
                          jnp.zeros_like(col(0)), keys, packed[0, w + 6], packed[0, w + 7], col(10), spec=spec,
                          max_seg=max_seg)


PREFILL_COLS = 4  # after the ids and the tables: start, real length, state slot, snapshot slot


def prefill_packed(eparams, pool, packed, *, spec: DecodeSpec, length: int):
    """`prefill_chunk` on packed inputs [B, length + Wc + PREFILL_COLS]: the chunk's ids, the rows' block tables
    over the positions the chunk reads, its start, its real length, and the rows' state and snapshot slots."""
    wc = packed.shape[1] - length - PREFILL_COLS
    ids, tables = packed[:, :length], packed[:, length: length + wc]
    col = lambda i: packed[:, length + wc + i]
    return prefill_chunk(eparams, pool, ids, tables, col(0), col(1), jnp.zeros_like(col(0)), col(2), col(3),
                         spec=spec)


def copy_packed(pool, packed):
    """`copy_pages` of one shard: packed [4, C] (source pages, destination pages, source and destination state
    slots)."""
    return copy_pages(pool, packed[0:1], packed[1:2], packed[2], packed[3])
