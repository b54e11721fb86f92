"""The paged engine's device memory: what one page and the temporaries cost, how large each shard's pool is, and
the refusal of a request that cannot fit.

A pool's size is decided once, at the first call (when the trainer's state is on the devices), and kept: its
shape is in every program's key, so a size taken from the free memory of the moment, or from a call's rows,
would recompile them at a later call. Where there is no budget (no `kv_cache_memory_bytes`, no allocator
statistics: the CPU) the pool holds what a shard can ever hold at once, `max_num_seqs` rows of
`max_model_len` tokens, whatever the call. It changes only when it must: a pool sized from
`gpu_memory_utilization` shrinks when what the devices already hold has grown so much that it no longer fits
(a recompile is better than running out of memory), and, where `max_model_len` is None, the block tables'
width (and so the unbudgeted pool) grows for a longer row. A linear-attention model (Qwen3.5) also takes state
slots out of the same budget (`_with_state_slots`); without a budget, slots for `max_num_seqs` rows.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import distributed
from jaxrl_llm.rollout.base import RolloutError
from jaxrl_llm.rollout.ladders import ATTN_BYTES
from jaxrl_llm.rollout.page_pool import KvBudget, kv_bytes_per_token, pages_for, size_pool

log = logging.getLogger(__name__)

SHRINK_SLACK = 0.98  # a sized pool is kept while the budget still holds this share of it


class EngineMemory:
    """Mixin of JaxEngine: pool sizing and the up-front memory check (uses its config attributes)."""

    @property
    def _kv_heads_local(self) -> int:
        k = self.cfg.num_key_value_heads
        return k // self._tensor if k % self._tensor == 0 else k

    def page_bytes(self) -> int:
        """One page's K and V over every attention layer, on one device."""
        itemsize = jnp.dtype(self.cfg.dtype).itemsize
        attention_layers = self.cfg.num_hidden_layers - len(self.cfg.layer_stacks.get("linear_layers", ()))
        return self.page_size * kv_bytes_per_token(attention_layers, self._kv_heads_local, self.cfg.head_dim, itemsize)

    def state_bytes(self) -> int:
        """One state slot (conv window and recurrent state) over every linear-attention layer, on one device."""
        c = self.cfg
        linear = len(c.layer_stacks.get("linear_layers", ()))
        conv = (c.linear_conv_kernel_dim - 1) * c.linear_conv_dim * jnp.dtype(c.dtype).itemsize
        rec = (c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
               * jnp.dtype(self.linear_state_dtype).itemsize)
        return linear * (conv + rec)

    def _with_state_slots(self, want: KvBudget, model_len: int) -> KvBudget:
        """A linear-attention model's budget: the slot cap and state slots carved out of `want`'s pages (see the
        module docstring)."""
        sb, pb = self.state_bytes(), want.page_bytes
        if want.source == "unbounded":  # no budget: slots for max_num_seqs rows (not a call's), pages as for attention
            cap = self.max_num_seqs
            return dataclasses.replace(want, state_slots=cap + max(1, cap // 4) + 1, slot_cap=cap)
        total = want.num_pages * pb
        per_row = sb * 1.25 + pages_for(max(1, model_len // 2), self.page_size) * pb
        cap = max(1, min(self.max_num_seqs, int(total // per_row)))
        slots = cap + max(1, cap // 4) + 1
        pages = max(0, int((total - slots * sb) // pb))
        return dataclasses.replace(want, num_pages=pages, state_slots=slots, slot_cap=cap)

    def _layer_state_fp32(self) -> int:
        """One row's recurrent state in one linear layer, in fp32 (how prefill computes it)."""
        c = self.cfg
        return c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4

    def prefill_row_cap(self) -> int:
        """Rows a prefill call takes at most (0: no cap): a Qwen3.5's rows each carry an fp32 recurrent state
        through a linear layer's chunked form (a few copies of it), held within ATTN_BYTES."""
        if not self.cfg.is_hybrid:
            return 0
        return max(1, ATTN_BYTES // (4 * self._layer_state_fp32()))

    def workspace_bytes(self, table_width: int) -> int:
        """The decode and prefill temporaries a device holds beside the pool (an estimate from shapes)."""
        c, itemsize = self.cfg, jnp.dtype(self.cfg.dtype).itemsize
        s = self.max_num_seqs
        v, n, kh = c.vocab_size, c.num_attention_heads, self._kv_heads_local
        decode = s * v * 4 * 4  # fp32 logits, their log-softmax and the sampler's temporaries
        if self.decode_attention == "xla":  # one layer's gathered pages and scores
            decode += s * table_width * self.page_size * (2 * kh * c.head_dim * itemsize + n * 4 * 2)
        t = self.max_num_batched_tokens
        width = c.intermediate_size or c.moe_intermediate_size * c.num_experts_per_tok
        prefill = t * (3 * c.hidden_size + c.q_dim + 2 * c.kv_dim + 3 * width) * itemsize
        prefill += 2 * ATTN_BYTES
        if c.is_hybrid:  # a linear layer's rows' new states (decode), and its chunked form's states (prefill)
            decode += 2 * s * self._layer_state_fp32() // 4 * jnp.dtype(self.linear_state_dtype).itemsize
            prefill += ATTN_BYTES + t * c.linear_conv_dim * 4 * 4
        return int(max(decode, prefill) + (256 << 20))

    def _pool_budget(self, longest: int) -> KvBudget:
        """Each shard's pool (see the module docstring); every process builds the same. Without a budget: a page
        for every position of `max_num_seqs` rows of `max_model_len` tokens (the block tables' width when it is
        None), and the scratch page. `longest`: the call's longest row, for a linear-attention model's share of a
        budget where max_model_len is None (its width grows with the rows then anyway)."""
        width = self.ladders.width
        model_len = self.max_model_len or width * self.page_size  # tokens a row holds at most
        unbounded = self.max_num_seqs * pages_for(model_len, self.page_size) + 1
        workspace = max(self.workspace_bytes(width), self._workspace_floor)  # the floor: what built programs showed
        want = size_pool(page_bytes=self.page_bytes(), workspace=workspace,
                         gpu_memory_utilization=self.gpu_memory_utilization,
                         kv_cache_memory_bytes=self.kv_cache_memory_bytes, unbounded_pages=unbounded,
                         device=self._base.devices[0])
        if self.cfg.is_hybrid:
            want = self._with_state_slots(want, self.max_model_len or longest + 1)
        if distributed.process_count() > 1:
            pages, slots, cap = (min(v) for v in zip(*distributed.allgather_objects(
                (want.num_pages, want.state_slots, want.slot_cap))))
            want = dataclasses.replace(want, num_pages=pages, state_slots=slots, slot_cap=cap)
        have = self._budget
        held = any(s.pool is not None for s in self.local_shards)  # then in_use counts the pool itself
        if have is not None and (not self._must_resize(have, want) or (held and want.source == have.source
                                                                       == "gpu_memory_utilization")):
            return have
        if have is not None:  # a shrink under memory pressure is worth a warning; an unbounded pool's growth is not
            (log.warning if want.source == "gpu_memory_utilization" else log.info)(
                "paged engine: the KV pool goes from %d to %d pages a shard (%s); its programs are built again",
                have.num_pages, want.num_pages, want.source)
            self.release()
        self._budget = want
        return want

    @staticmethod
    def _must_resize(have: KvBudget, want: KvBudget) -> bool:
        if want.source != have.source or want.source == "kv_cache_memory_bytes":
            return want.num_pages != have.num_pages
        if want.source == "unbounded":
            return want.num_pages > have.num_pages
        if want.state_slots != have.state_slots:
            return want.state_slots < SHRINK_SLACK * have.state_slots
        return want.num_pages < SHRINK_SLACK * have.num_pages

    def _check_fits(self, budget: KvBudget, longest: int, prompt_len: int, max_new: int) -> None:
        usable = budget.num_pages - 1
        need = pages_for(longest, self.page_size)
        if usable >= need:
            return
        gib = budget.num_pages * budget.page_bytes / 2**30
        where = {"kv_cache_memory_bytes": f"rollout.kv_cache_memory_bytes = {self.kv_cache_memory_bytes}",
                 "gpu_memory_utilization": (f"rollout.gpu_memory_utilization = {self.gpu_memory_utilization} of "
                                            f"{budget.device_limit / 2**30:.1f} GiB, less {budget.in_use / 2**30:.1f} "
                                            f"GiB in use and {budget.workspace / 2**30:.1f} GiB of workspace"),
                 "unbounded": "the unbounded pool"}[budget.source]
        raise RolloutError(
            f"the KV pool cannot hold one longest response: it has {max(usable, 0)} usable pages of {self.page_size} "
            f"tokens a device ({gib:.2f} GiB, from {where}), and a row of prompt {prompt_len} + max_new_tokens "
            f"{max_new} tokens needs {need}. Raise rollout.gpu_memory_utilization or set "
            "rollout.kv_cache_memory_bytes, lower data.max_response_length or data.max_prompt_length, or free "
            "device memory (trainer.ref_offload, a tensor-parallel mesh with train.mesh_tensor)")

    def memory_report(self) -> list[tuple[str, int]]:
        """The largest programs a shard runs, each with the bytes a device needs while it runs (beyond the
        trainer's states), from XLA's compiled memory analysis: the engine's weights (less the experts it reads in
        place: the trainer's) and a KV pool that serves one longest row (`max_model_len`) are its inputs, plus its
        new outputs and temporaries. The trainer's memory check (trainer/memory/check.py) holds them against the
        device before the first step. Programs: decode over the top slot bucket (`max_num_seqs`), the longest fresh
        prefill and the continuation one."""
        from jaxrl_llm.rollout import paged_decode
        from jaxrl_llm.rollout.base import SamplingParams
        from jaxrl_llm.rollout.ladders import Ladders, pow2

        if self.params is None:
            return []
        base = self._base
        model_len = self.max_model_len or self.max_prompt_length + 1
        lad = Ladders(width=pow2(pages_for(model_len, self.page_size)), page_size=self.page_size,
                      num_heads=self.cfg.num_attention_heads, max_batched_tokens=self.max_num_batched_tokens,
                      max_prompt=self.max_prompt_length, slot_cap=self.max_num_seqs, max_rows=self.prefill_row_cap())
        spec = self.call_spec(SamplingParams())
        pool = self.abstract_pool(spec, pages_for(model_len, self.page_size) + 1, self.max_num_seqs + 2, base)
        fresh, cont = lad.fresh_lengths(self.max_prompt_length)[-1], lad.cont_lengths[-1]
        programs = [
            ("decode", "_decode", np.zeros((lad.slot_cap_bucket, lad.width + paged_decode.DECODE_COLS), np.int32), {}),
            (f"prefill {fresh}", "_prefill", np.zeros((lad.rows(fresh, True), fresh + lad.table_width(fresh, True)
                                                       + paged_decode.PREFILL_COLS), np.int32), {"length": fresh}),
            (f"prefill {cont} (continuation)", "_prefill", np.zeros((lad.rows(cont, False), cont + lad.width
                                                                    + paged_decode.PREFILL_COLS), np.int32),
             {"length": cont}),
        ]
        # Experts read in place (engine_weights.py) are the trainer's own buffers, held by it already (the check
        # counts them among its states): an input of every program here, but no memory of the engine's.
        shared = sum(_device_bytes(x) for x in jax.tree.leaves(base.params.get("experts", {})))

        def one(program) -> tuple[str, int]:
            label, name, packed, static = program
            with jax.set_mesh(base.mesh):  # (a thread's own context)
                args = self._abstract((base.params, pool, packed), base.mesh)
                stats = getattr(type(self), name).lower(self, *args, spec=spec, **static).compile().memory_analysis()
            need = sum(_device_bytes(x) for x in jax.tree.leaves(args)) - shared
            if stats is not None:
                need += stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
            return label, int(need)

        # On threads: XLA compiles outside Python's lock (Qwen3.5-35B-A3B's decode and prefill took 101 and 87 s
        # one after the other on an H200, 2026-12-02).
        with concurrent.futures.ThreadPoolExecutor(len(programs)) as ex:
            return list(ex.map(one, programs))

    def abstract_pool(self, spec, num_pages: int, state_slots: int, shard):
        """ShapeDtypeStructs of a shard's pool (its programs' input): pages [K, P, ps, H] per attention layer, state
        slots (replicated over the shard's devices) per linear layer."""
        from jaxrl_llm.rollout import paged_decode

        shape = (spec.num_kv_heads, num_pages, self.page_size, spec.head_dim)
        page = jax.ShapeDtypeStruct(shape, jnp.dtype(self.cfg.dtype), sharding=shard.pool_sharding(shape))
        conv, rec = paged_decode.state_shapes(spec, state_slots)
        slots = (jax.ShapeDtypeStruct(conv, jnp.dtype(self.cfg.dtype), sharding=shard.replicated),
                 jax.ShapeDtypeStruct(rec, jnp.dtype(spec.state_dtype), sharding=shard.replicated))
        return [slots if i in spec.linear_layers else (page, page) for i in range(spec.num_layers)]

    def release(self) -> None:
        """Frees the KV pools now (they are re-allocated, at the same size, by the next `generate`)."""
        for s in self.shards:
            if s.pool is not None:
                for k, v in s.pool:
                    k.delete()
                    v.delete()
            s.release()

    @property
    def _pool(self):
        """The base shard's pool (None when released)."""
        return self._base.pool


def _device_bytes(x) -> int:
    """One device's share of an array (or ShapeDtypeStruct with a sharding)."""
    sh = getattr(x, "sharding", None)
    shape = x.shape if sh is None else sh.shard_shape(x.shape)
    return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def beside_inputs(compiled) -> int:
    """Bytes a compiled program needs beyond its inputs: temporaries and the outputs not aliased to donated
    inputs (0 where the backend gives no analysis)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (a backend without the analysis)
        return 0
    if m is None:
        return 0
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
