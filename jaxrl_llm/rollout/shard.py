"""One data-parallel shard of the paged engine: its devices, its view of the weights, its KV pool, and its loop.

The engine (rollout/jax_engine.py) splits its mesh into data-parallel groups (the devices of one shard: one
device, or the `tensor` devices that split its heads). Each group is a `Shard` and runs as an engine of its
own, on its own thread: its own scheduler over its own pool, its own slot bucket and stop rule, on programs
compiled once for the first shard and loaded onto the others (rollout/programs.py). No shard waits for
another's rows; the only thing shards share is the dealer they take prompt groups from (rollout/dealer.py).

A shard's weights are a view of the engine's: the engine layout is replicated over the data-parallel axes,
so every shard's devices already hold a whole copy, and the view is built from those buffers with no copy.

Per decode segment the host does array operations only (the scheduler's growth and commit) and makes one
host-to-device copy of the packed inputs (rollout/paged_decode.py, DECODE_COLS) and one device-to-host copy
of the outputs.

Where a request's seconds go (`phase_s`, `phase_calls` in the shard's statistics, `PHASES`): the host clocks every
phase of the loop. Prefill and copy calls are dispatched without waiting, so their device time lands in the next
call that waits (the decode's fetch) unless the engine's `phase_timing` is on: then each prefill and copy call
waits for its pool (`block_until_ready`), and each phase's seconds are its own (the bench's `gen` section).
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as Pspec

from jaxrl_llm import distributed, sharding
from jaxrl_llm.rollout import paged_decode
from jaxrl_llm.rollout.ladders import Chunk
from jaxrl_llm.rollout.page_pool import PagePool
from jaxrl_llm.rollout.routing import record_routes
from jaxrl_llm.rollout.scheduler import Plan, Scheduler

# The loop's phases: planning (admission, growth), prefill calls, page and state copies (copy on write, the state
# forks of a prompt's samples), a segment's packing, its decode call (dispatch to fetched outputs), its commit,
# waiting for rows (a shard run dry) and the stream's hooks between segments.
PHASES = ("plan", "prefill", "copy", "pack", "decode", "commit", "wait", "hooks")


class Shard:
    """One shard's devices and state; `run` drives its rows of a request to the end.

    Args:
      engine: the JaxEngine (its config, its programs, its jitted functions).
      index: the shard's place among the engine's shards.
      mesh: the shard's own mesh (the engine's axes, sizes 1 but for `tensor`).
    """

    def __init__(self, engine, index: int, mesh: Mesh):
        self.engine, self.index, self.mesh = engine, index, mesh
        self.devices = list(mesh.devices.flat)
        self.local = all(d.process_index == jax.process_index() for d in self.devices)
        self.replicated = NamedSharding(mesh, Pspec())
        self.params = None
        self.version = 0  # the weights' version its params are (tokens record it)
        self.pool = None
        self.num_pages = 0
        self.state_slots = 0  # a linear-attention model's state slots in the pool (0: none)
        self.programs: dict = {}  # (program, host input shape, static) -> the compiled program on these devices

    # ---- weights and memory ------------------------------------------------------------------
    def set_params(self, engine_params, version: int = 0) -> None:
        """This shard's view of the engine's weights (the same buffers, no copy); None drops it."""
        self.params = None if engine_params is None else jax.tree.map(self._view, engine_params)
        self.version = version

    def _view(self, x: jax.Array) -> jax.Array:
        mine = {d: s.data for s in x.addressable_shards if (d := s.device) in self.devices}
        return jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(self.mesh, x.sharding.spec), [mine[d] for d in self.devices if d in mine])

    def pool_sharding(self, shape) -> NamedSharding:
        return NamedSharding(self.mesh, sharding.logical_to_spec(paged_decode.POOL_AXES, shape, self.mesh))

    def alloc(self, num_pages: int, spec, state_slots: int = 0) -> None:
        """A zeroed pool of `num_pages` pages (and `state_slots` state slots) on this shard's devices."""
        eng = self.engine
        shape = (spec.num_kv_heads, num_pages, eng.page_size, spec.head_dim)
        fn = eng._alloc_fn(self, num_pages, spec, self.pool_sharding(shape), state_slots)
        if (num_pages, state_slots) != (self.num_pages, self.state_slots):
            self.programs.clear()  # the pool's shape is in every program's key
        self.pool = fn()
        self.num_pages, self.state_slots = num_pages, state_slots

    def release(self) -> None:
        self.pool = None

    def put(self, x: np.ndarray) -> jax.Array:
        """A host array replicated over this shard's devices."""
        return distributed.put(x, self.replicated)

    # ---- a request ---------------------------------------------------------------------------
    def run(self, source, spec, stop: threading.Event, hooks=None) -> dict:
        """Runs the rows `source` deals this shard, to the end; returns the shard's statistics.

        `hooks` (a rollout stream, rollout/stream.py): `at_boundary(shard, sched)` between segments (where new
        weights are taken), `finished(rows)` after each commit, and a source that stays open for more rows."""
        eng = self.engine
        lad = eng.ladders
        states = PagePool(self.state_slots, 1) if self.state_slots else None
        sched = Scheduler(PagePool(self.num_pages, eng.page_size), source, slot_cap=lad.slot_cap,
                          max_seg=eng.max_segment, width=lad.width, share_prompts=eng.share_prompt_pages,
                          states=states)
        st = dict(segments=0, decode_steps=0, row_steps=0, prefill_calls=0, plan_s=0.0, tokens=0,
                  phase_s=dict.fromkeys(PHASES, 0.0), phase_calls=dict.fromkeys(PHASES, 0))
        t0 = time.perf_counter()
        while not stop.is_set():
            if hooks is not None:
                t = time.perf_counter()
                hooks.at_boundary(self, sched)
                _clock(st, "hooks", t)
            if sched.done():
                break
            t = time.perf_counter()
            plan = sched.plan()
            st["plan_s"] += _clock(st, "plan", t)
            for call in lad.calls(plan.prefills):
                t = time.perf_counter()
                self._prefill(call, spec)
                self._sync()
                _clock(st, "prefill", t)
                st["prefill_calls"] += 1
            if len(plan.copies[0]) or len(plan.state_copies[0]):
                t = time.perf_counter()
                self._copy(plan.copies, plan.state_copies)
                self._sync()
                _clock(st, "copy", t)
            if plan.live:
                done = self._segment(plan, sched, spec, st)
                if hooks is not None and done:
                    t = time.perf_counter()
                    hooks.finished(done)
                    _clock(st, "hooks", t)
            elif not plan.prefills:
                t = time.perf_counter()
                source.wait()  # nothing to run here now: until rows come, or none can
                _clock(st, "wait", t)
        st.update(sched.stats, seconds=time.perf_counter() - t0)
        return st

    def _sync(self) -> None:
        """Waits for the pool's last update where the engine times its phases (else the call runs on)."""
        if getattr(self.engine, "phase_timing", False):
            jax.block_until_ready(self.pool)

    def _prefill(self, call: list[Chunk], spec) -> None:
        eng, lad = self.engine, self.engine.ladders
        length, fresh = call[0].length, call[0].fresh
        options = lad.row_options(length, fresh)
        b = options[0] if len(call) <= options[0] else options[-1]
        wc = lad.table_width(length, fresh)
        packed = np.zeros((b, length + wc + paged_decode.PREFILL_COLS), np.int32)
        for i, c in enumerate(call):
            pages = c.task.pages[:wc]
            packed[i, : c.end - c.start] = c.task.row.context()[c.start: c.end]
            packed[i, length: length + len(pages)] = pages
            packed[i, length + wc: length + wc + 4] = c.start, c.end - c.start, c.task.slot, c.task.snap
        prog = eng._shard_program(self, "_prefill", (self.params, self.pool, packed),
                                  {"spec": spec, "length": length})
        self.pool, routes = prog(self.params, self.pool, self.put(packed))
        if routes is not None:  # [b, length, L_moe, k]
            routes = distributed.fetch(routes)
            for i, c in enumerate(call):
                record_routes(c.task.row, c.start, routes[i, : c.end - c.start])

    def _copy(self, copies: tuple[np.ndarray, np.ndarray], state_copies: tuple[np.ndarray, np.ndarray]) -> None:
        """The round's page and state copies, in one call of the narrowest copy width that takes them (rollout/
        ladders.py; calls of the top width where they pass it, which no round of the scheduler's does)."""
        lad = self.engine.ladders
        top = lad.copy_widths[-1]
        for a in range(0, max(len(copies[0]), len(state_copies[0])), top):
            pages, states = [x[a: a + top] for x in copies], [x[a: a + top] for x in state_copies]
            c = lad.copy_width(max(len(pages[0]), len(states[0])))
            packed = np.zeros((4, c), np.int32)  # unused pairs copy the scratch page (and slot) onto itself
            packed[0, : len(pages[0])], packed[1, : len(pages[1])] = pages
            packed[2, : len(states[0])], packed[3, : len(states[1])] = states
            prog = self.engine._shard_program(self, "_copy", (self.pool, packed), {})
            self.pool = prog(self.pool, self.put(packed))

    def _segment(self, plan: Plan, sched: Scheduler, spec, st: dict) -> list:
        """One decode segment. On GPUs the call returns when the segment is done (XLA runs the data-dependent
        while loop from the host), so the shard's thread waits there, with the GIL released, while the other
        shards run; `plan_s` counts the host's own work (planning, packing, committing)."""
        t0 = time.perf_counter()
        s, n, w = plan.slots, plan.live, sched.width
        packed = np.zeros((s, w + paged_decode.DECODE_COLS), np.int32)
        packed[:n, :w] = sched.table[:n]
        packed[:n, w: w + 6] = np.stack([sched.ctx[:n], sched.last[:n], sched.ntok[:n], sched.maxtok[:n],
                                         np.ones(n, np.int64), sched.stream[:n]], axis=1)
        packed[:, w + 6], packed[:, w + 7] = plan.seg, plan.stop_free
        packed[:n, w + 8: w + 10] = sched.keys[:n]
        packed[:n, w + 10] = sched.slot[:n]
        prog = self.engine._shard_program(self, "_decode", (self.params, self.pool, packed), {"spec": spec})
        st["plan_s"] += _clock(st, "pack", t0)
        t0 = time.perf_counter()
        self.pool, out = prog(self.params, self.pool, self.put(packed))
        out = distributed.fetch_tree(out)
        _clock(st, "decode", t0)
        t0 = time.perf_counter()
        if "routing" in out:  # step j fed position ctx + j
            for i in range(n):
                record_routes(sched.rows[i], int(sched.ctx[i]), out["routing"][i, : int(out["count"][i])])
        done = sched.commit(out["tokens"], out["logps"], out["count"], out["active"], self.version)
        st["plan_s"] += _clock(st, "commit", t0)
        st["segments"] += 1
        st["decode_steps"] += int(out["steps"])
        st["row_steps"] += int(out["steps"]) * s
        st["tokens"] += int(out["count"][:n].sum())
        return done


def _clock(st: dict, phase: str, t0: float) -> float:
    """Adds the seconds since `t0` to `phase` of the shard's statistics (and one call); returns them."""
    dt = time.perf_counter() - t0
    st["phase_s"][phase] += dt
    st["phase_calls"][phase] += 1
    return dt


def call_phases(shard_stats: list[dict], prepare_s: float, seconds: float) -> dict:
    """A call's seconds by phase: `prepare` (the pools' budget, programs built, pools allocated), each loop phase
    summed over the shards (PHASES), the shards' loops outside those phases (`loop_other`), and
    the call's time outside the longest shard's loop (`outside`: dealing, releasing the pools, gathering). On one
    shard they add up to `seconds`; `phase_calls` counts each phase's calls."""
    phase_s = {"prepare": prepare_s}
    calls = {"prepare": 1}
    for st in shard_stats:
        for k, v in st["phase_s"].items():
            phase_s[k] = phase_s.get(k, 0.0) + v
            calls[k] = calls.get(k, 0) + st["phase_calls"][k]
    phase_s["loop_other"] = sum(st["seconds"] - sum(st["phase_s"].values()) for st in shard_stats)
    phase_s["outside"] = seconds - prepare_s - max((st["seconds"] for st in shard_stats), default=0.0)
    return {"phase_s": {k: round(v, 4) for k, v in phase_s.items()}, "phase_calls": calls}
