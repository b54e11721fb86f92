"""How the JAX engine builds its programs (a part of `JaxEngine`, rollout/jax_engine.py): their keys and input
shapes, the compiled program of each shard (built once for the first, loaded onto the others), the block tables'
width, and the warm-up that builds every program of the ladders before a call needs it (`prepare`, and `warm`
ahead of the first call, beside the trainer's own compile-ahead)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrl_llm.rollout import paged_decode
from jaxrl_llm.rollout.base import RolloutError, SamplingParams
from jaxrl_llm.rollout.engine_memory import beside_inputs
from jaxrl_llm.rollout.ladders import MIN_COPY, Ladders, pow2
from jaxrl_llm.rollout.page_pool import pages_for
from jaxrl_llm.rollout.programs import Programs, default_dir
from jaxrl_llm.rollout.scheduler import slot_ladder, slot_width
from jaxrl_llm.rollout.shard import Shard

log = logging.getLogger(__name__)


class EngineBuild:
    """The program building of `JaxEngine` (its attributes: `cfg`, `mesh`, `ladders`, the shards and budgets)."""

    def _programs_for(self) -> Programs:
        """The engine's programs; built on first use, and loading those kept by an earlier run from then on."""
        if self._programs is None:
            self._programs = Programs(self._fingerprint(), self._base.devices, default_dir())
            self._programs.preload()
        return self._programs

    def _fingerprint(self) -> str:
        base = (dict(self._base.mesh.shape), [d.id for d in self._base.devices])
        return repr((type(self).__name__, self.cfg, self.page_size, self.max_segment, self.decode_attention, base,
                     paged_decode.GDN_DECODE_IMPL))

    def _abstract(self, args, mesh: Mesh):
        """`args` as ShapeDtypeStructs on `mesh` (device arrays keep their partition spec, written out to one entry
        a dimension so that a program's output and a fresh array of the same layout key the same program; host
        arrays are replicated): the shapes a program of `mesh`'s devices is compiled for."""
        def one(x):
            spec = tuple(getattr(getattr(x, "sharding", None), "spec", ()))
            spec = jax.sharding.PartitionSpec(*spec, *([None] * (len(x.shape) - len(spec))))
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

        return jax.tree.map(one, args)

    def _shard_program(self, shard: Shard, name: str, args: tuple, static: dict):
        """The compiled program `name` of `shard` for inputs shaped like `args`: compiled (or loaded) once for
        the base shard, then loaded onto `shard`'s devices; compiled for them where that cannot be done. The
        shard keeps the handle under the host input's shape (its weights' and pool's shapes are fixed), so a
        segment finds its program without hashing the inputs."""
        memo = (name, args[-1].shape, tuple(sorted(static.items())))
        if memo in shard.programs:
            return shard.programs[memo]
        base, programs = self._base, self._programs_for()
        jitted = getattr(type(self), name)
        abstract = self._abstract(args, base.mesh)
        with jax.set_mesh(base.mesh):
            compiled = programs.get(name, jitted, self, abstract, static)
        moved = compiled
        if shard is not base:
            moved = None
            if shard.local and base.local:
                moved = programs.for_group(programs.key(name, abstract, static), compiled, base.devices, shard.devices)
            if moved is None:
                own = self._abstract(args, shard.mesh)
                with jax.set_mesh(shard.mesh):
                    moved = programs.get(f"{name}@{shard.index}", jitted, self, own, static)
        shard.programs[memo] = moved
        return moved

    def _warm(self, spec, rows: int, budget, probe: bool = False) -> int:
        """Builds every program this call's shards can reach (decode over each slot bucket up to the rows a
        shard may hold, the prefill and copy ladders) in parallel threads, before the pools are allocated (so
        XLA's autotuning has the device's memory); then loads them onto the other shards. Returns the most bytes
        one of them needs beside its inputs (XLA's temporaries and new outputs; 0 where nothing is built). `probe`,
        under a device share: first the widest program of each kind alone; one needing more than the workspace
        returns its need with nothing else built, and `prepare` sizes the pool again (not all built twice)."""
        lad, base = self.ladders, self._base
        top = slot_width(min(lad.slot_cap, rows), lad.slot_cap)  # the widest segment a shard runs
        num_pages = budget.num_pages
        if not self.warm_programs:
            return 0
        if (spec, top, num_pages, lad) in self._warmed:
            return self._warmed[(spec, top, num_pages, lad)]
        pool = self.abstract_pool(spec, num_pages, budget.state_slots, base)
        params = base.params
        shapes = [("_decode", (params, pool, np.zeros((s, lad.width + paged_decode.DECODE_COLS), np.int32)),
                   {"spec": spec}) for s in slot_ladder(lad.slot_cap) if s <= top]
        for fresh, lengths in ((True, lad.fresh_lengths(lad.max_prompt)), (False, lad.cont_lengths)):
            for length in lengths:
                for b in lad.row_options(length, fresh):
                    packed = np.zeros((b, length + lad.table_width(length, fresh) + paged_decode.PREFILL_COLS),
                                      np.int32)
                    shapes.append(("_prefill", (params, pool, packed), {"spec": spec, "length": length}))
        shapes += [("_copy", (pool, np.zeros((4, c), np.int32)), {}) for c in lad.copy_widths]
        programs = self._programs_for()
        items = [(name, getattr(type(self), name), self, self._abstract(args, base.mesh), static)
                 for name, args, static in shapes]
        if probe and budget.source == "gpu_memory_utilization":  # the widest program of each kind first
            widest = list({it[0]: it for it in sorted(items, key=lambda it: math.prod(it[3][-1].shape))}.values())
            programs.warm(widest, context=lambda: jax.set_mesh(base.mesh))
            need = max(beside_inputs(programs.get(*item)) for item in widest)
            if need > budget.workspace:
                return need
        programs.warm(items, context=lambda: jax.set_mesh(base.mesh))
        need = max(beside_inputs(programs.get(*item)) for item in items)  # held now: no build
        moves = [(shard, *shape) for shard in self.local_shards[1:] for shape in shapes]
        if moves:  # loading an executable (about 0.5 s for a 7B program on a GPU) releases the GIL: in parallel
            with concurrent.futures.ThreadPoolExecutor(min(programs.threads, len(moves))) as ex:
                for f in [ex.submit(self._shard_program, *m) for m in moves]:
                    f.result()
        self._warmed[(spec, top, num_pages, lad)] = need
        return need

    def warm(self, sampling: SamplingParams, rows: int) -> None:
        """Builds, before any call, every program that a call of `rows` rows sampled with `sampling` reaches, as
        that call's `prepare` would (the block tables at `max_model_len`, the pool sized, the ladders' programs on
        threads) but allocating nothing: the call then compiles none. The trainer calls it while its worker
        compiles the step's programs on threads of their own (trainer/roles/host.py). Nothing where
        `warm_programs` is off."""
        if not self.warm_programs or self.params is None:
            return
        spec = self.call_spec(sampling)
        max_new = sampling.max_new_tokens
        longest = (self.max_model_len or self.max_prompt_length + max_new) - 1
        t0 = time.perf_counter()
        self.prepare(spec, rows, longest, min(self.max_prompt_length, longest), max_new, allocate=False)
        log.info("paged engine: programs for calls of %d rows built ahead in %.1f s", rows, time.perf_counter() - t0)

    def prepare(self, spec, rows: int, longest: int, prompt_len: int, max_new: int, *, allocate: bool = True):
        """Before any work: the table width and the pools' size (refusing what cannot fit), the programs built,
        each local shard's pool allocated (unless not `allocate`: `warm`). Returns the pools' budget."""
        self._fix_width(longest)
        for attempt in range(3):
            with jax.set_mesh(self.mesh):
                budget = self._pool_budget(longest)
            if budget.slot_cap and budget.slot_cap != self.ladders.slot_cap:  # state slots bound the rows at once
                self.ladders = dataclasses.replace(self.ladders, slot_cap=budget.slot_cap)
            self._check_fits(budget, longest, prompt_len, max_new)
            need = self._warm(spec, rows, budget, probe=attempt < 2)  # the last try builds all, whatever it needs
            # A pool sized from the device's share leaves `workspace` for the programs' temporaries, estimated from
            # shapes; built, XLA's own figure is known. Where a program needs more, the pool is sized again
            # leaving that (and its programs built again), instead of that program running out of memory.
            if budget.source != "gpu_memory_utilization" or need <= budget.workspace:
                break
            log.warning("paged engine: a program needs %.2f GiB beside its inputs, over the %.2f GiB workspace the "
                        "pool was sized with; sizing the pool again", need / 2**30, budget.workspace / 2**30)
            self._workspace_floor = need
            self._budget = None
            self.release()
        for s in self.local_shards:
            if allocate and s.pool is None:
                s.alloc(budget.num_pages, spec, budget.state_slots)
        return budget

    def _fix_width(self, longest: int) -> None:
        """The block tables' width, from `max_model_len` (fixed), or grown to cover the longest row so far."""
        if self.max_model_len is not None and longest + 1 > self.max_model_len:
            raise RolloutError(f"a row of {longest + 1} tokens (prompt + max_new_tokens) exceeds the engine's "
                               f"max_model_len {self.max_model_len} (rollout.max_model_len; default "
                               "data.max_prompt_length + data.max_response_length)")
        need = pow2(pages_for(self.max_model_len or longest, self.page_size))
        if self.ladders is None or need > self.ladders.width:
            if self.ladders is not None:
                log.info("paged engine: rows of %d tokens need a wider block table (%d -> %d pages): new programs",
                         longest + 1, self.ladders.width, need)
            self.ladders = Ladders(width=need, page_size=self.page_size, num_heads=self.cfg.num_attention_heads,
                                   max_batched_tokens=self.max_num_batched_tokens,
                                   max_prompt=self.max_prompt_length, slot_cap=self.max_num_seqs,
                                   max_rows=self.prefill_row_cap(), copy_floor=MIN_COPY if self.cfg.is_hybrid else 0)
