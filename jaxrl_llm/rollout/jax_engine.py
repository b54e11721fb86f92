"""The JAX-native rollout engine: a paged KV pool under a memory budget, with continuous batching.

Per `generate` call:

* **Pool**: pages of `page_size` tokens, sized once from the budget (`gpu_memory_utilization` of the
  device's memory, counting what the trainer and the engine's weights already hold, or an explicit
  `kv_cache_memory_bytes`) and released after the call when `free_cache_engine`, so the update gets
  the memory back. A request whose longest row cannot fit the whole pool is refused before any work,
  with the keys to change.
* **Scheduler** (rollout/scheduler.py): every row waits in a queue; rows are admitted while pages and
  slots (`max_num_seqs`) are free, refilled as rows finish, and the newest are preempted and
  recomputed when pages run out. The `n` samples of a prompt share its prompt pages.
* **Device** (rollout/paged_decode.py): chunked prefill into pages (`max_num_batched_tokens` a call),
  then decode segments of up to `max_segment` steps, attention through block tables (the Pallas kernel
  in kernels/paged_attention.py on GPUs, an XLA gather elsewhere). Slots, prefill rows and chunk
  lengths come from power-of-two ladders, so a run compiles a fixed set of programs.

Greedy tokens and log-probs equal the dense engine's (rollout/dense_engine.py) and transformers'.
Random draws too: row r's token t is drawn from fold_in(fold_in(key(seed), r), t) in both engines,
whatever batch or slot it ran in and however often it was preempted (`seeds` replaces r by the caller's
own stream id, as the agent loop does for each turn of a trajectory).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm import distributed
from jaxrl_llm.models.config import Qwen2Config
from jaxrl_llm.rollout import paged_decode
from jaxrl_llm.rollout.base import RolloutBatch, RolloutError, SamplingParams
from jaxrl_llm.rollout.engine_weights import EngineWeights, resolve_decode_attention, row_budgets, row_streams
from jaxrl_llm.rollout.page_pool import KvBudget, PagePool, kv_bytes_per_token, pages_for, size_pool
from jaxrl_llm.rollout.programs import Programs, default_dir
from jaxrl_llm.rollout.routing import record_routes, routed_experts_of_rows
from jaxrl_llm.rollout.scheduler import MIN_SLOTS, PrefillTask, Row, Scheduler, slot_bucket

log = logging.getLogger(__name__)

ATTN_BYTES = 512 << 20  # a prefill call's fp32 attention scores stay under this (chunks shrink as contexts grow)
MIN_CHUNK = 16


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _floor_pow2(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


@gin.configurable
class JaxEngine(EngineWeights):
    """Generates responses with the model's own JAX code on a paged KV pool; the default engine.

    Args:
      cfg: the model config (its dtype fields are replaced by `dtype`).
      params: trainer params (any sharding), or None to set them later with `update_weights`.
      mesh: the device mesh (None: the first device).
      dtype: engine weights, activations and KV dtype.
      max_prompt_length: longest accepted prompt.
      max_num_seqs: rows decoded together at most (decode slots over all data-parallel shards).
      max_num_batched_tokens: prompt tokens one prefill call processes at most.
      page_size: tokens a KV page holds.
      gpu_memory_utilization: the share of the device's memory that total use (trainer state, engine
        weights, KV pool and the engine's temporaries) may reach while generating.
      kv_cache_memory_bytes: the KV pool's bytes per device; overrides the share.
      free_cache_engine: release the pool after every `generate` (else keep it for the next call).
      decode_attention: "pallas" (the paged kernel; interpret mode off GPU), "xla" (a gather of each
        row's pages), or "auto": the kernel on GPUs where its shapes allow, XLA elsewhere.
      max_segment: decode steps between scheduling decisions at most.
      share_prompt_pages: the n samples of a prompt share its prompt's pages.
    """

    def __init__(self, cfg: Qwen2Config, params=None, *, mesh: Mesh | None = None, dtype: str = "bfloat16",
                 max_prompt_length: int = 1024, max_num_seqs: int = 1024, max_num_batched_tokens: int = 8192,
                 page_size: int = 16, gpu_memory_utilization: float = 0.9, kv_cache_memory_bytes: int | None = None,
                 free_cache_engine: bool = True, decode_attention: str = "auto", max_segment: int = 64,
                 share_prompt_pages: bool = True):
        _check(page_size >= 1 and page_size & (page_size - 1) == 0, "rollout.page_size",
               f"{page_size}: use a power of two (16 is vLLM's default)")
        _check(max_num_seqs >= 1, "rollout.max_num_seqs", f"{max_num_seqs}: need >= 1")
        _check(max_num_batched_tokens >= MIN_CHUNK, "rollout.max_num_batched_tokens",
               f"{max_num_batched_tokens}: need >= {MIN_CHUNK}")
        _check(0.0 < gpu_memory_utilization <= 1.0, "rollout.gpu_memory_utilization",
               f"{gpu_memory_utilization}: need a fraction in (0, 1]")
        _check(kv_cache_memory_bytes is None or kv_cache_memory_bytes > 0, "rollout.kv_cache_memory_bytes",
               f"{kv_cache_memory_bytes}: need a positive byte count, or None to size from the fraction")
        from kernels.paged_attention import paged_attention_supported

        self.decode_attention = resolve_decode_attention(
            decode_attention, paged_attention_supported(page_size, cfg.head_dim),
            f"a power-of-two page size and head dim >= 16 (page {page_size}, head dim {cfg.head_dim})")
        super().__init__(cfg, params, mesh=mesh, dtype=dtype, max_prompt_length=max_prompt_length)
        self.max_num_seqs = max(self._dp, max_num_seqs - max_num_seqs % self._dp)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.free_cache_engine = free_cache_engine
        self.max_segment = max_segment
        self.share_prompt_pages = share_prompt_pages
        self._tensor = self.mesh.shape["tensor"] if self.mesh is not None and "tensor" in self.mesh.shape else 1
        self._pool = None
        self._budget: KvBudget | None = None
        self._programs: Programs | None = None
        self.last_stats: dict = {}
        self._programs_for()  # a warm cache's programs load while the caller does other work

    # ---- memory ------------------------------------------------------------------------------
    @property
    def _kv_heads_local(self) -> int:
        k = self.cfg.num_key_value_heads
        return k // self._tensor if k % self._tensor == 0 else k

    def page_bytes(self) -> int:
        """One page's K and V over every layer, on one device."""
        itemsize = jnp.dtype(self.cfg.dtype).itemsize
        return self.page_size * kv_bytes_per_token(self.cfg.num_hidden_layers, self._kv_heads_local,
                                                   self.cfg.head_dim, itemsize)

    def workspace_bytes(self, table_width: int) -> int:
        """The decode and prefill temporaries a device holds beside the pool (an estimate from shapes)."""
        c, itemsize = self.cfg, jnp.dtype(self.cfg.dtype).itemsize
        s = -(-self.max_num_seqs // self._dp)
        v, n, kh = c.vocab_size, c.num_attention_heads, self._kv_heads_local
        decode = s * v * 4 * 4  # fp32 logits, their log-softmax and the sampler's temporaries
        if self.decode_attention == "xla":  # one layer's gathered pages and scores
            decode += s * table_width * self.page_size * (2 * kh * c.head_dim * itemsize + n * 4 * 2)
        t = self.max_num_batched_tokens
        prefill = t * (3 * c.hidden_size + c.q_dim + 2 * c.kv_dim + 3 * c.intermediate_size) * itemsize
        prefill += 2 * ATTN_BYTES
        return int(max(decode, prefill) + (256 << 20))

    def _size_pool(self, rows: int, longest: int, table_width: int) -> KvBudget:
        per_shard_rows = min(-(-rows // self._dp), self.max_num_seqs // self._dp)
        unbounded = self._dp * (per_shard_rows * pages_for(longest, self.page_size) + 1)
        budget = size_pool(page_bytes=self.page_bytes(), shards=self._dp, workspace=self.workspace_bytes(table_width),
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           kv_cache_memory_bytes=self.kv_cache_memory_bytes, unbounded_pages=unbounded)
        if distributed.process_count() > 1:  # every process must build the same pool
            pages = min(distributed.allgather_objects(budget.num_pages))
            budget = KvBudget(pages, budget.page_bytes, budget.source, budget.device_limit, budget.in_use,
                              budget.workspace)
        return budget

    def _check_fits(self, budget: KvBudget, longest: int, prompt_len: int, max_new: int) -> None:
        usable = budget.num_pages // self._dp - 1
        need = pages_for(longest, self.page_size)
        if usable >= need:
            return
        gib = budget.num_pages // self._dp * budget.page_bytes / 2**30
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

    def release(self) -> None:
        """Frees the KV pool now (it is re-allocated by the next `generate`)."""
        if self._pool is not None:
            for k, v in self._pool:
                k.delete()
                v.delete()
        self._pool = None

    # ---- jitted programs ---------------------------------------------------------------------
    @functools.partial(jax.jit, static_argnums=(0,), static_argnames=("num_pages", "spec"))
    def _alloc(self, *, num_pages, spec):
        return paged_decode.alloc_pool(num_pages, self.page_size, spec, jnp.dtype(self.cfg.dtype))

    @functools.partial(jax.jit, static_argnums=(0,), static_argnames=("spec",), donate_argnums=(2,))
    def _prefill(self, eparams, pool, ids, tables, start, length, scratch, *, spec):
        return paged_decode.prefill_chunk(eparams, pool, ids, tables, start, length, scratch, spec=spec)

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
    def _copy(self, pool, src, dst):
        return paged_decode.copy_pages(pool, src, dst)

    @functools.partial(jax.jit, static_argnums=(0,), static_argnames=("spec",), donate_argnums=(2,))
    def _decode(self, eparams, pool, tables, pos, last, t, row_max, active, rids, scratch, key, seg_len, stop_free,
                *, spec):
        return paged_decode.decode_segment(eparams, pool, tables, pos, last, t, row_max, active, rids, scratch, key,
                                           seg_len, stop_free, spec=spec, max_seg=self.max_segment)

    def _program(self, name: str, *args, **static):
        """The compiled program `name` for these inputs (see rollout/programs.py); call it with `args`."""
        keep = name != "_alloc"  # zeros: compiled in milliseconds, and kept only in memory
        return self._programs_for().get(name, getattr(type(self), name), self, args, static, keep=keep)

    def _programs_for(self) -> Programs:
        """The engine's programs; built on first use, and loading those kept by an earlier run from then on."""
        if self._programs is None:
            devices = self.mesh.devices.flat if self.mesh is not None else jax.devices()[:1]
            self._programs = Programs(self._fingerprint(), devices, default_dir())
            self._programs.preload()
        return self._programs

    def _fingerprint(self) -> str:
        mesh = None if self.mesh is None else (dict(self.mesh.shape), self.mesh.device_ids.tolist())
        return repr((type(self).__name__, self.cfg, self.page_size, self.max_segment, self.decode_attention, mesh))

    def _decode_args(self, pool, s: int, width: int, key, spec) -> tuple:
        """Inputs of a decode segment over `s` slots (zeros; their shapes and shardings key the program)."""
        z = self._put(np.zeros(s, np.int32))
        return (self.params, pool, self._put(np.zeros((s, width), np.int32)), z, z, z, z,
                self._put(np.zeros(s, bool)), z, z, key, np.int32(0), np.int32(0))

    def _warm_decode(self, rows: int, num_pages: int, width: int, key, spec) -> None:
        """Builds the decode programs of every slot bucket this call can reach, in parallel threads, before
        the pool is allocated (so XLA's autotuning has the device's memory). Not on the CPU backend, where the
        compiles share the cores that run them and a short rollout reaches few of the buckets."""
        if jax.devices()[0].platform == "cpu":
            return
        cap = max(1, self.max_num_seqs // self._dp)
        top = min(cap, max(1, -(-rows // self._dp)))
        widths = sorted({min(cap, max(MIN_SLOTS, slot_bucket(k))) for k in range(1, top + 1)})
        pool = self._program("_alloc", num_pages=num_pages, spec=spec).out_info
        items = [("_decode", type(self)._decode, self, self._decode_args(pool, w * self._dp, width, key, spec),
                  {"spec": spec}) for w in widths]
        self._programs_for().warm(items, context=self._mesh_ctx)

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
        spec = self._request_spec(prompts, sampling, row_max)
        streams = row_streams(seeds, len(prompts) * n)
        rows = [Row(rid=i * n + j, prompt=i, ids=list(map(int, prompts[i])), max_tokens=int(row_max[i * n + j]),
                    stream=int(streams[i * n + j])) for i in range(len(prompts)) for j in range(n)]
        if spec.record_routing:
            for r in rows:
                r.routes = np.full((len(r.ids) + r.max_tokens, spec.num_moe_layers, spec.moe_top_k), -1, np.int32)
        longest_row = max(rows, key=lambda r: len(r.ids) + r.max_tokens)
        longest = len(longest_row.ids) + longest_row.max_tokens - 1  # positions a row writes at most
        width = _pow2(pages_for(longest, self.page_size))
        t0 = time.perf_counter()
        with self._mesh_ctx():
            budget = self._budget
            if self._pool is None:
                budget = self._size_pool(len(rows), longest, width)
            self._check_fits(budget, longest, len(longest_row.ids), longest_row.max_tokens)
            key = jax.random.key(sampling.seed)
            self._warm_decode(len(rows), budget.num_pages, width, key, spec)
            if self._pool is None:
                self._pool = self._program("_alloc", num_pages=budget.num_pages, spec=spec)()
                self._budget = budget
            pool = PagePool(budget.num_pages, self.page_size, self._dp)
            sched = Scheduler(pool, rows, max_num_seqs=self.max_num_seqs, max_seg=self.max_segment,
                              share_prompts=self.share_prompt_pages)
            stats = dict(segments=0, row_steps=0, decode_steps=0, prefill_calls=0)
            try:
                while not sched.done():
                    plan = sched.plan()
                    self._run_prefills(plan.prefills, pool, width, spec, stats)
                    if plan.copies:
                        self._run_copies(plan.copies, pool)
                    self._run_segment(plan, sched, pool, width, key, spec, stats)
            finally:
                if self.free_cache_engine:
                    self.release()
        stats.update(sched.stats, num_pages=budget.num_pages, page_size=self.page_size,
                     kv_bytes=budget.num_pages // self._dp * budget.page_bytes, budget_source=budget.source,
                     workspace_bytes=budget.workspace, seconds=time.perf_counter() - t0,
                     tokens=sum(len(r.tokens) for r in rows))
        self.last_stats = stats
        return self._result(rows, len(prompts), n, spec)

    def _result(self, rows: list[Row], num_prompts: int, n: int, spec) -> RolloutBatch:
        lengths = np.asarray([len(r.tokens) for r in rows], np.int32)
        width = int(lengths.max())
        tokens = np.full((len(rows), width), spec.pad_id, np.int32)
        logps = np.zeros((len(rows), width), np.float32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.tokens)] = r.tokens
            logps[i, : len(r.logps)] = r.logps
        stop_set = set(spec.stop_ids)
        reasons = ["stop" if r.tokens[-1] in stop_set else "length" for r in rows]
        return RolloutBatch(prompt_index=np.repeat(np.arange(num_prompts), n), tokens=tokens, logprobs=logps,
                            lengths=lengths, finish_reasons=reasons, weight_version=self.version,
                            routed_experts=routed_experts_of_rows(rows, width) if spec.record_routing else None)

    def _local(self, pool: PagePool, page: int) -> int:
        return page - pool.shard_of(page) * pool.per_shard

    def _run_prefills(self, tasks: list[PrefillTask], pool: PagePool, width: int, spec, stats: dict) -> None:
        """Prefills in chunks: fresh rows first (their pages may be shared by resumed rows), each phase in
        waves (chunk i of every row, then chunk i + 1), each wave in calls of similar chunk lengths."""
        n_heads = self.cfg.num_attention_heads
        for phase in ([t for t in tasks if not t.row.tokens], [t for t in tasks if t.row.tokens]):
            cursor = {id(t): t.start for t in phase}
            while True:
                wave = []
                for t in phase:
                    a = cursor[id(t)]
                    if a >= t.end:
                        continue
                    ctx = _pow2(pages_for(t.end, self.page_size)) * self.page_size
                    cap = min(self.max_num_batched_tokens, max(MIN_CHUNK, ATTN_BYTES // (n_heads * 4 * ctx)))
                    b = min(t.end, a + _floor_pow2(cap))
                    wave.append((t, a, b))
                    cursor[id(t)] = b
                if not wave:
                    break
                wave.sort(key=lambda w: -(w[2] - w[1]))
                while wave:
                    wave = self._prefill_call(wave, pool, width, spec, n_heads)
                    stats["prefill_calls"] += 1

    def _prefill_call(self, wave, pool: PagePool, width: int, spec, n_heads: int):
        """One prefill call on the longest chunks of `wave` (sorted by length); returns the rest."""
        length = max(MIN_CHUNK, _pow2(wave[0][2] - wave[0][1]))
        ctx_pages = _pow2(max(pages_for(b, self.page_size) for _, _, b in wave))
        ctx_pages = min(ctx_pages, width)
        per_call = max(1, min(self.max_num_batched_tokens // length,
                              ATTN_BYTES // (n_heads * 4 * length * ctx_pages * self.page_size)))
        per_shard = _floor_pow2(max(1, per_call // self._dp))
        take, rest, counts = [], [], [0] * self._dp
        for w in wave:
            shard = w[0].row.shard
            if counts[shard] < per_shard:
                counts[shard] += 1
                take.append(w)
            else:
                rest.append(w)
        b_local = _pow2(max(counts))
        b = b_local * self._dp
        ids = np.zeros((b, length), np.int32)
        tables = np.zeros((b, ctx_pages), np.int32)
        start = np.zeros(b, np.int32)
        lens = np.zeros(b, np.int32)
        fill = [0] * self._dp
        for task, a, e in take:
            row = task.row
            i = row.shard * b_local + fill[row.shard]
            fill[row.shard] += 1
            ctx = row.context()
            ids[i, : e - a] = ctx[a:e]
            pages = [self._local(pool, p) for p in task.pages[:ctx_pages]]
            tables[i, : len(pages)] = pages
            start[i], lens[i] = a, e - a
        args = (self.params, self._pool, self._put(ids), self._put(tables), self._put(start), self._put(lens),
                self._put(np.zeros(b, np.int32)))
        self._pool, routes = self._program("_prefill", *args, spec=spec)(*args)
        if routes is not None:  # [b, length, L_moe, k]
            routes = distributed.fetch_tree(routes)
            fill = [0] * self._dp
            for task, a, e in take:
                i = task.row.shard * b_local + fill[task.row.shard]
                fill[task.row.shard] += 1
                record_routes(task.row, a, routes[i, : e - a])
        return rest

    def _run_copies(self, copies: list[tuple[int, int]], pool: PagePool) -> None:
        per = [[] for _ in range(self._dp)]
        for src, dst in copies:
            per[pool.shard_of(src)].append((self._local(pool, src), self._local(pool, dst)))
        c = _pow2(max(len(p) for p in per))
        src = np.zeros((self._dp, c), np.int32)
        dst = np.zeros((self._dp, c), np.int32)
        for d, pairs in enumerate(per):
            for j, (s_, t_) in enumerate(pairs):
                src[d, j], dst[d, j] = s_, t_
        args = (self._pool, self._put(src), self._put(dst))
        self._pool = self._program("_copy", *args)(*args)

    def _run_segment(self, plan, sched: Scheduler, pool: PagePool, width: int, key, spec, stats: dict) -> None:
        slots = [r for shard in plan.slots for r in shard]
        s = len(slots)
        live = [r for r in slots if r is not None]
        tables = np.zeros((s, width), np.int32)
        pos, last, t, row_max, rids = (np.zeros(s, np.int32) for _ in range(5))
        active = np.zeros(s, bool)
        for i, r in enumerate(slots):
            if r is None:
                continue
            pages = [self._local(pool, p) for p in r.pages[:width]]
            tables[i, : len(pages)] = pages
            pos[i], last[i], t[i], row_max[i], rids[i] = r.context_len, r.pending, len(r.tokens), r.max_tokens, r.stream
            active[i] = True
        args = (self.params, self._pool, self._put(tables), self._put(pos), self._put(last), self._put(t),
                self._put(row_max), self._put(active), self._put(rids), self._put(np.zeros(s, np.int32)), key,
                np.int32(plan.seg), np.int32(plan.stop_free))
        self._pool, out = self._program("_decode", *args, spec=spec)(*args)
        out = distributed.fetch_tree(out)
        idx = [i for i, r in enumerate(slots) if r is not None]
        if "routing" in out:  # step j fed position pos + j
            for i in idx:
                record_routes(slots[i], int(pos[i]), out["routing"][i, : int(out["count"][i])])
        finished = ~out["active"][idx]
        sched.commit(live, out["tokens"][idx], out["logps"][idx], out["count"][idx], finished)
        stats["segments"] += 1
        stats["decode_steps"] += int(out["steps"])
        stats["row_steps"] += int(out["steps"]) * s


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{key} = {msg}")


def make_jax_engine(cfg: Qwen2Config, params, mesh: Mesh | None, *, rollout, max_prompt_length: int):
    """The trainer's JAX engine from its `rollout.*` config: paged (the default) or dense."""
    if rollout.kv_cache == "dense":
        from jaxrl_llm.rollout.dense_engine import DenseJaxEngine

        return DenseJaxEngine(cfg, params, mesh=mesh, dtype=cfg.dtype, max_prompt_length=max_prompt_length,
                              max_batch_size=rollout.max_batch_size, decode_attention=rollout.decode_attention)
    return JaxEngine(cfg, params, mesh=mesh, dtype=cfg.dtype, max_prompt_length=max_prompt_length,
                     max_num_seqs=rollout.max_num_seqs, max_num_batched_tokens=rollout.max_num_batched_tokens,
                     page_size=rollout.page_size, gpu_memory_utilization=rollout.gpu_memory_utilization,
                     kv_cache_memory_bytes=rollout.kv_cache_memory_bytes, free_cache_engine=rollout.free_cache_engine,
                     decode_attention=rollout.decode_attention)
