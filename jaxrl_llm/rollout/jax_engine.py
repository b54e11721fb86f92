"""The JAX-native rollout engine: paged KV pools under a memory budget, with continuous batching, one engine a
data-parallel shard.

Per `generate` call:

* **Shards** (rollout/shard.py): every data-parallel group of the mesh (one device, or the devices that split
  the heads over `tensor`) runs as an engine of its own, on a thread of its own, as vLLM runs one engine core
  per data-parallel rank: its own scheduler, page pool, slot bucket and stop rule. `max_num_seqs` and
  `max_num_batched_tokens` are per shard, as in vLLM. The request's prompt groups (a prompt's n samples
  together) are dealt out evenly before admission (rollout/dealer.py); a shard that runs dry takes groups
  that another has not admitted yet; no shard waits for another's rows.
* **Pool**: each shard's pages of `page_size` tokens, sized once from the budget (`gpu_memory_utilization` of
  the device's memory, counting what the trainer and the engine's weights already hold, or an explicit
  `kv_cache_memory_bytes`; without either, on the CPU, `max_num_seqs` rows of `max_model_len` tokens, whatever
  a call's rows) and kept at that size across calls (released after each call when
  `free_cache_engine`, so the update gets the memory back). A request whose longest row cannot fit a pool is
  refused before any work, with the keys to change.
* **Scheduler** (rollout/scheduler.py): admission while pages and slots are free, refills as rows finish,
  the newest preempted and recomputed when pages run out; the n samples of a prompt share its prompt pages.
* **Programs** (rollout/ladders.py, rollout/programs.py, rollout/engine_build.py): decode segments of up to
  `max_segment` steps over a slot bucket and a block table of fixed width (`max_model_len`), prefill chunks and
  copies (of a model with state slots, a ladder of widths: a round's state forks move about what they copy) from
  fixed ladders. They are built ahead in parallel before the first call, once for the first shard, and loaded
  onto every other shard's devices; nothing compiles at a later call. `last_stats` counts what a call compiled.

Greedy tokens and log-probs equal the dense engine's (rollout/dense_engine.py) and transformers'. Random draws
too: row r's token t is drawn from fold_in(fold_in(key(seed), r), t) in both engines, whatever shard, batch or
slot it ran in and however often it was preempted (`seeds` replaces r by the caller's own stream id, as the
agent loop does for each turn of a trajectory).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrl_llm import distributed, sharding
from jaxrl_llm.models.config import Qwen2Config
from jaxrl_llm.rollout import paged_decode
from jaxrl_llm.rollout.base import RolloutBatch, RolloutError, SamplingParams
from jaxrl_llm.rollout.dealer import Dealer, deal
from jaxrl_llm.rollout.engine_build import EngineBuild
from jaxrl_llm.rollout.engine_memory import EngineMemory
from jaxrl_llm.rollout.engine_weights import EngineWeights, resolve_decode_attention, row_budgets, row_streams
from jaxrl_llm.rollout.ladders import Ladders
from jaxrl_llm.rollout.programs import Programs
from jaxrl_llm.rollout.routing import routed_experts_of_rows
from jaxrl_llm.rollout.rows import Row, RowStore
from jaxrl_llm.rollout.shard import Shard, call_phases

log = logging.getLogger(__name__)


@gin.configurable
class JaxEngine(EngineBuild, EngineMemory, EngineWeights):
    """Generates responses with the model's own JAX code on paged KV pools; the default engine.

    Args:
      cfg: the model config (its dtype fields are replaced by `dtype`).
      params: trainer params (any sharding), or None to set them later with `update_weights`.
      mesh: the device mesh (None: the first device). Every data-parallel group of it is a shard.
      dtype: engine weights, activations and KV dtype.
      max_prompt_length: longest accepted prompt.
      max_model_len: prompt + response tokens a row holds at most (the block tables' width); None: the first
        call's longest row, growing (with new programs) when a later call needs more.
      max_num_seqs: rows a shard decodes together at most (per data-parallel shard, as vLLM's).
      max_num_batched_tokens: prompt tokens one prefill call of a shard processes at most.
      page_size: tokens a KV page holds.
      gpu_memory_utilization: the share of the device's memory that total use (trainer state, engine
        weights, KV pool and the engine's temporaries) may reach while generating.
      kv_cache_memory_bytes: the KV pool's bytes per device; overrides the share.
      free_cache_engine: release the pools after every `generate` (else keep them for the next call).
      decode_attention: "pallas" (the paged kernel; interpret mode off GPU), "xla" (a gather of each
        row's pages), or "auto": the kernel on GPUs where its shapes allow, XLA elsewhere.
      max_segment: decode steps between scheduling decisions at most.
      share_prompt_pages: the n samples of a prompt share its prompt's pages.
      warm_programs: build every program of the ladders before the first call: "auto" (on accelerators; on
        the CPU programs compile when first needed), True or False.
      phase_timing: each prefill and copy call waits for its pool, so `last_stats["phase_s"]` gives each phase of
        a call its own device time (rollout/shard.py); off, they run on and their time lands in the next wait.
      linear_state_dtype: the dtype of a Qwen3.5 linear layer's recurrent state in the engine's state slots:
        "auto" (the engine's `dtype`), "float32" (as transformers keeps it) or "bfloat16" (half what a decode
        step reads and writes).
      state_update: how a decode step writes a linear layer's new states: "in_place" (the kernel writes each slot
        in the pool's own buffer: 2 passes over each; the 9B's generation at 256 rows took 16.6 s on an H100
        against 34.8 s) or "scatter" (the kernel writes the rows' states, XLA scatters them into their slots: 4).
    """

    def __init__(self, cfg: Qwen2Config, params=None, *, mesh: Mesh | None = None, dtype: str = "bfloat16",
                 max_prompt_length: int = 1024, max_model_len: int | None = None, max_num_seqs: int = 1024,
                 max_num_batched_tokens: int = 8192, page_size: int = 16, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_bytes: int | None = None, free_cache_engine: bool = True,
                 decode_attention: str = "auto", max_segment: int = 64, share_prompt_pages: bool = True,
                 warm_programs: bool | str = "auto", linear_state_dtype: str = "auto", phase_timing: bool = False,
                 state_update: str = "in_place"):
        _check(page_size >= 1 and page_size & (page_size - 1) == 0, "rollout.page_size",
               f"{page_size}: use a power of two (16 is vLLM's default)")
        _check(max_num_seqs >= 1, "rollout.max_num_seqs", f"{max_num_seqs}: need >= 1")
        _check(max_num_batched_tokens >= 16, "rollout.max_num_batched_tokens", f"{max_num_batched_tokens}: need >= 16")
        _check(0.0 < gpu_memory_utilization <= 1.0, "rollout.gpu_memory_utilization",
               f"{gpu_memory_utilization}: need a fraction in (0, 1]")
        _check(kv_cache_memory_bytes is None or kv_cache_memory_bytes > 0, "rollout.kv_cache_memory_bytes",
               f"{kv_cache_memory_bytes}: need a positive byte count, or None to size from the fraction")
        _check(max_model_len is None or max_model_len >= 2, "rollout.max_model_len",
               f"{max_model_len}: need prompt + response tokens (>= 2), or None")
        _check(linear_state_dtype in ("auto", "float32", "bfloat16"), "rollout.linear_state_dtype",
               f"{linear_state_dtype!r}: use 'auto', 'float32' or 'bfloat16'")
        _check(state_update in ("scatter", "in_place"), "rollout.state_update", f"{state_update!r}: use 'scatter' or "
               "'in_place'")
        self.linear_state_dtype = dtype if linear_state_dtype == "auto" else linear_state_dtype
        self.state_update = state_update
        from kernels.paged_attention import paged_attention_supported

        self.decode_attention = resolve_decode_attention(
            decode_attention, paged_attention_supported(page_size, cfg.head_dim),
            f"a power-of-two page size and head dim >= 16 (page {page_size}, head dim {cfg.head_dim})")
        if mesh is None:  # one device: a mesh of one, so every path is the sharded one
            mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        super().__init__(cfg, params=None, mesh=mesh, dtype=dtype, max_prompt_length=max_prompt_length)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.free_cache_engine = free_cache_engine
        self.max_segment = max_segment
        self.share_prompt_pages = share_prompt_pages
        self.warm_programs = (jax.devices()[0].platform != "cpu") if warm_programs == "auto" else bool(warm_programs)
        self.phase_timing = phase_timing
        self._tensor = self.mesh.shape.get("tensor", 1)
        self.shards = self._make_shards()
        me = jax.process_index()  # the global index, as devices carry it (not the side's, distributed.set_group)
        self.local_shards = [s for s in self.shards if any(d.process_index == me for d in s.devices)]
        # Stealing depends on timing: only where no shard's devices span processes (see rollout/dealer.py).
        self._steal = all(len({d.process_index for d in s.devices}) == 1 for s in self.shards)
        self.ladders: Ladders | None = None
        self._budget = None
        self._programs: Programs | None = None
        self._alloc_fns: dict = {}
        self._warmed: dict = {}  # (spec, top slots, pages, ladders) -> the largest temporaries of their programs
        self._workspace_floor = 0  # bytes the built programs showed they need beside the pool (engine_memory)
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self.last_stats: dict = {}
        if params is not None:
            self.update_weights(params)
        self._programs_for()  # a warm cache's programs load while the caller does other work

    def _make_shards(self) -> list[Shard]:
        """A shard per data-parallel group: the devices at one (data, fsdp, expert) place, in tensor order."""
        devs = self.mesh.devices.reshape(-1, self._tensor)
        shape = tuple(1 if a != "tensor" else self._tensor for a in self.mesh.axis_names)
        return [Shard(self, i, Mesh(devs[i].reshape(shape), self.mesh.axis_names,
                                    axis_types=self.mesh.axis_types)) for i in range(devs.shape[0])]

    @property
    def _base(self) -> Shard:
        """The shard whose devices programs are compiled for (the first this process drives)."""
        return self.local_shards[0]

    # ---- weights -----------------------------------------------------------------------------
    def update_weights(self, params, *, step: int | None = None) -> int:
        for s in self.shards:  # the views hold the old weights' buffers: drop them before the new copy
            s.set_params(None)
        version = super().update_weights(params, step=step)
        for s in self.local_shards:
            s.set_params(self.params, version)
        return version

    def release_weights(self) -> None:
        for s in self.shards:
            s.set_params(None)
        super().release_weights()

    # ---- programs ----------------------------------------------------------------------------
    @functools.partial(jax.jit, static_argnums=(0,), static_argnames=("spec", "length"), donate_argnums=(2,))
    def _prefill(self, eparams, pool, packed, *, spec, length):
        return paged_decode.prefill_packed(eparams, pool, packed, spec=spec, length=length)

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
    def _copy(self, pool, packed):
        return paged_decode.copy_packed(pool, packed)

    @functools.partial(jax.jit, static_argnums=(0,), static_argnames=("spec",), donate_argnums=(2,))
    def _decode(self, eparams, pool, packed, *, spec):
        return paged_decode.decode_packed(eparams, pool, packed, spec=spec, max_seg=self.max_segment)

    def _alloc_fn(self, shard: Shard, num_pages: int, spec, pool_sharding: NamedSharding, state_slots: int = 0):
        """The zeroed-pool program of one shard (compiled in milliseconds, kept in memory)."""
        key = (shard.index, num_pages, state_slots, spec.num_layers, spec.num_kv_heads, spec.head_dim,
               spec.linear_layers, spec.state_dtype)
        if key not in self._alloc_fns:
            dt = jnp.dtype(self.cfg.dtype)
            fn = functools.partial(paged_decode.alloc_pool, num_pages, self.page_size, spec, dt, state_slots)
            out = [(shard.replicated, shard.replicated) if i in spec.linear_layers else (pool_sharding, pool_sharding)
                   for i in range(spec.num_layers)]
            with jax.set_mesh(shard.mesh):
                self._alloc_fns[key] = jax.jit(fn, out_shardings=out)
        return self._alloc_fns[key]

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 max_new_tokens_per_row: Sequence[int] | None = None,
                 seeds: Sequence[int] | None = None) -> RolloutBatch:
        """Samples `sampling.n` responses for every prompt (prompt-major order in the result).

        `max_new_tokens_per_row` optionally caps each response row (len(prompts) * n values, each
        <= sampling.max_new_tokens), like per-request budgets in vLLM. `seeds` optionally names each
        row's random stream (len(prompts) * n ints in [0, 2**31); default: the row's index).
        """
        n = sampling.n
        row_max = row_budgets(max_new_tokens_per_row, len(prompts) * n, sampling.max_new_tokens)
        spec = self.paged_spec(prompts, sampling, row_max)
        streams = row_streams(seeds, len(prompts) * n)
        store = RowStore(len(prompts) * n, int(row_max.max()), spec.pad_id)
        rows = make_rows(prompts, n, row_max, streams, store, key_data(sampling.seed), spec)
        longest_row = max(rows, key=lambda r: len(r.ids) + r.max_tokens)
        longest = len(longest_row.ids) + longest_row.max_tokens - 1  # positions a row writes at most
        before = dict(self._programs_for().stats)
        t0 = time.perf_counter()
        shard_stats: list[dict] = []
        try:
            budget = self.prepare(spec, len(rows), longest, len(longest_row.ids), longest_row.max_tokens)
            prepare_s = time.perf_counter() - t0
            groups = [rows[i * n:(i + 1) * n] for i in range(len(prompts))]
            dealer = Dealer(deal(groups, len(self.shards)), [s.index for s in self.local_shards], steal=self._steal)
            shard_stats = self.run_shards(dealer, spec)
        finally:
            if self.free_cache_engine:
                self.release()
        if distributed.process_count() > 1:
            self._gather(rows, store, dealer)
        self.last_stats = self._stats(shard_stats, budget, dealer, before, time.perf_counter() - t0, store)
        self.last_stats.update(call_phases(shard_stats, prepare_s, self.last_stats["seconds"]))
        return self._result(rows, store, len(prompts), n, spec)

    def paged_spec(self, prompts, sampling: SamplingParams, row_max: np.ndarray):
        """The request's decode spec (`call_spec`), checked before any work."""
        self._request_spec(prompts, sampling, row_max)
        return self.call_spec(sampling)

    def call_spec(self, sampling: SamplingParams):
        """The decode spec that keys a call's programs: the rows' budgets are an input of the programs, not part
        of their key."""
        return dataclasses.replace(self._spec(sampling, self.decode_attention), max_new_tokens=0)

    def run_shards(self, dealer: Dealer, spec, hooks=None) -> list[dict]:
        """Runs every local shard to the end, each on its own thread; the first failure stops the others."""
        stop = threading.Event()

        def one(shard: Shard) -> dict:
            try:
                return shard.run(dealer.source(shard.index), spec, stop, hooks)
            except BaseException:
                stop.set()
                dealer.close()  # wakes shards that wait for rows
                raise

        if len(self.local_shards) == 1:
            return [one(self.local_shards[0])]
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(len(self.local_shards), thread_name_prefix="shard")
        futures = [self._threads.submit(one, s) for s in self.local_shards]
        return [f.result() for f in futures]

    def _gather(self, rows: list[Row], store: RowStore, dealer: Dealer) -> None:
        """Every process's rows on every process (each ran its own shards' rows)."""
        mine = np.asarray(sorted(r.rid for q in (dealer.dealt[s.index] for s in self.local_shards)
                                 for g in q for r in g), np.int64)
        length = store.lengths[mine]
        width = int(length.max()) if mine.size else 0
        routes = [rows[i].routes for i in mine] if rows[0].routes is not None else None
        parts = distributed.allgather_objects((mine, length, store.tokens[mine, :width], store.logps[mine, :width],
                                               routes))
        for rids, lengths, tokens, logps, part_routes in parts:
            store.lengths[rids] = lengths
            store.tokens[rids, : tokens.shape[1]] = tokens
            store.logps[rids, : logps.shape[1]] = logps
            if part_routes is not None:
                for i, r in zip(rids, part_routes):
                    rows[i].routes = r

    def _stats(self, shard_stats: list[dict], budget, dealer: Dealer, before: dict, seconds: float,
               store: RowStore) -> dict:
        sums = ("segments", "decode_steps", "row_steps", "prefill_calls", "preemptions", "admitted",
                "prefill_tokens", "shared_pages", "copies", "state_copies")
        out = {k: sum(s[k] for s in shard_stats) for k in sums}
        after = self._programs_for().stats
        out.update(
            shards=len(self.shards), shard_segments=[s["segments"] for s in shard_stats],
            shard_seconds=[round(s["seconds"], 4) for s in shard_stats],
            shard_tokens=[s["tokens"] for s in shard_stats], plan_s=max((s["plan_s"] for s in shard_stats), default=0),
            stolen=dealer.stolen, num_pages=budget.num_pages, page_size=self.page_size,
            kv_bytes=budget.num_pages * budget.page_bytes, budget_source=budget.source,
            state_slots=budget.state_slots, slot_cap=self.ladders.slot_cap,
            workspace_bytes=budget.workspace, table_width=self.ladders.width, seconds=seconds,
            tokens=int(store.lengths.sum()),
            programs_compiled=after["compiled"] - before.get("compiled", 0),
            programs_loaded=after["loaded"] - before.get("loaded", 0),
            programs_moved=after["moved"] - before.get("moved", 0),
            compile_s=after["compile_s"] - before.get("compile_s", 0.0))
        return out

    def _result(self, rows: list[Row], store: RowStore, num_prompts: int, n: int, spec) -> RolloutBatch:
        lengths = store.lengths.copy()
        width = int(lengths.max())
        mask = np.arange(width)[None, :] < lengths[:, None]
        tokens = np.where(mask, store.tokens[:, :width], spec.pad_id).astype(np.int32)
        logps = np.where(mask, store.logps[:, :width], 0.0).astype(np.float32)
        last = store.tokens[np.arange(len(rows)), np.maximum(lengths - 1, 0)]
        reasons = np.where(np.isin(last, np.asarray(spec.stop_ids, np.int32)), "stop", "length").tolist()
        return RolloutBatch(prompt_index=np.repeat(np.arange(num_prompts), n), tokens=tokens, logprobs=logps,
                            lengths=lengths, finish_reasons=reasons, weight_version=self.version,
                            routed_experts=routed_experts_of_rows(rows, width) if spec.record_routing else None,
                            token_versions=np.where(mask, store.versions[:, :width], 0).astype(np.int32))


def key_data(seed: int) -> np.ndarray:
    """[2] int32: the PRNG key of `seed` as the decode programs take it (bit-cast uint32 words)."""
    return np.asarray(jax.random.key_data(jax.random.key(seed))).view(np.int32).reshape(-1)


def make_rows(prompts, n: int, row_max: np.ndarray, streams: np.ndarray, store: RowStore, key: np.ndarray,
              spec, first: int = 0) -> list[Row]:
    """The response rows of `prompts` (prompt-major; row ids from `first`), each with its budget, stream and key."""
    ids = [np.asarray(p, np.int32) for p in prompts]
    rows = [Row(rid=first + i * n + j, prompt=first // n + i, ids=ids[i], max_tokens=int(row_max[i * n + j]),
                store=store, stream=int(streams[i * n + j]), key=key) for i in range(len(prompts)) for j in range(n)]
    if spec.record_routing:
        for r in rows:
            r.routes = np.full((len(r.ids) + r.max_tokens, spec.num_moe_layers, spec.moe_top_k), -1, np.int32)
    return rows


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{key} = {msg}")


def make_jax_engine(cfg: Qwen2Config, params, mesh: Mesh | None, *, rollout, max_prompt_length: int,
                    max_model_len: int | None = None):
    """The trainer's JAX engine from its `rollout.*` config: paged (the default) or dense."""
    if rollout.kv_cache == "dense" and cfg.is_hybrid:
        raise RolloutError(f"rollout.kv_cache = 'dense' does not serve {cfg.model_type} (Qwen3.5's linear-attention "
                           "layers keep a recurrent state, which only the paged engine holds); use "
                           "rollout.kv_cache = 'paged'")
    if rollout.kv_cache == "dense":
        from jaxrl_llm.rollout.dense_engine import DenseJaxEngine

        return DenseJaxEngine(cfg, params, mesh=mesh, dtype=cfg.dtype, max_prompt_length=max_prompt_length,
                              max_batch_size=rollout.max_batch_size, decode_attention=rollout.decode_attention)
    return JaxEngine(cfg, params, mesh=mesh, dtype=cfg.dtype, max_prompt_length=max_prompt_length,
                     max_model_len=max_model_len, max_num_seqs=rollout.max_num_seqs,
                     max_num_batched_tokens=rollout.max_num_batched_tokens, page_size=rollout.page_size,
                     gpu_memory_utilization=rollout.gpu_memory_utilization,
                     kv_cache_memory_bytes=rollout.kv_cache_memory_bytes, free_cache_engine=rollout.free_cache_engine,
                     decode_attention=rollout.decode_attention,
                     linear_state_dtype=rollout.linear_state_dtype, state_update=rollout.state_update,
                     warm_programs="auto" if rollout.warm_programs is None else rollout.warm_programs)
