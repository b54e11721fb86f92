"""The memory check before the first step: every program of the step, as XLA compiled it, against the device.

`plan` builds the run's states as shapes alone (a `TrainerWorker` on ShapeDtypeStructs: nothing is loaded
or allocated), compiles each program of the step for its fixed shapes (`jitted.lower(...).compile()`) and
reads XLA's own account of it (`memory_analysis()`: arguments, outputs, outputs aliased to donated inputs,
temporaries; per device). A program needs what stays resident while it runs, plus its inputs that are not
resident, its new outputs and its temporaries (`ProgramMemory`). The programs (trainer/memory/programs.py):

  actor update, critic update    the grad step on one full micro-batch (actor.ppo_max_token_len_per_gpu)
  actor / critic optimizer       AdamW on the trained leaves, in place
  old / reference log-prob, critic values   the forward passes on one micro-batch of the log-prob budget (the
                                            old and reference ones as one program, where fused)
  weight sync: merge, convert    the merged adapters, then the engine's layout (the JAX engine)
  generation                     the sampler's programs, as the engine reports them (`check_engine`)

Resident: the trainers' params, optimizer states and frozen bases, the reference copy (full fine-tuning,
unless offloaded), and the engine's weights and KV pool, each except where the run releases it
(`rollout.free_cache_engine` drops both for the updates; a sync drops the old weights first).

Automatic settings: `model.remat='auto'` takes the first policy of `AUTO_LADDER` (models/remat.py: "dots",
"mlp_gate", "attention_block", "attention", "full": the least recompute first) whose update fits in
`AUTO_SHARE` of the limit (the arithmetic first pass, trainer/memory/estimate.py, skips without compiling them the
policies that cannot fit), the last one ("full") where none does; `rollout.log_prob_max_token_len_per_gpu =
None` takes twice the update's budget where that pass fits, else the update's; `rollout.fuse_log_prob_passes`
is turned off where only the two passes apart fit. A program that fits no choice in `FIT_SHARE` of the limit
stops the run before any work, with one DeviceMemoryError naming the program, its sizes and the keys that
shrink it.

The limit is `train.device_memory_limit_bytes`, else what XLA may use on the device (`bytes_limit`). A CPU
reports none, so CPU runs skip the check unless that key sets one (the tests do); XLA:CPU's analysis
differs from a GPU's (it runs bf16 matmuls in fp32 and materializes attention), so CPU figures are for
tests. The compiled programs land in JAX's persistent cache (`train.compilation_cache_dir`), where the
first step finds them.

The engine's side, a protocol: an engine may define `memory_report() -> list[tuple[str, int]]`, for each
of its programs the name and the bytes a device needs while it runs beyond the trainer's states: the
engine's weights (less the buffers it shares with the trainer), its KV pool at the smallest size that serves
one longest row of the run, and the program's XLA arguments, outputs and temporaries. An engine without it
is not checked here (its own checks still run when it sizes the pool).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from jaxrl_llm import distributed
from jaxrl_llm.errors import DeviceMemoryError
from jaxrl_llm.models.remat import AUTO_LADDER
from jaxrl_llm.trainer.memory import estimate as memory
from jaxrl_llm.trainer.memory.programs import ProgramMemory, StepPrograms, size

log = logging.getLogger(__name__)

FIT_SHARE = 0.97  # a program fits in this share of the limit; the rest is for the allocator's fragmentation
AUTO_SHARE = 0.90  # an automatic setting takes its faster choice only where it fits in this share
GB = 1e9


@dataclasses.dataclass
class MemoryPlan:
    """The check's outcome: `run` and `cfg` with the automatic settings resolved, the limit it used (None:
    no check), the programs it compiled, and what the trainer holds while the engine generates."""

    run: object
    cfg: object
    limit: int | None
    programs: list = dataclasses.field(default_factory=list)
    generation_held: dict = dataclasses.field(default_factory=dict)
    generation_fixes: list = dataclasses.field(default_factory=list)

    def check_engine(self, engine) -> None:
        """The sampler's programs, where the engine reports them (`memory_report`, see the module docstring)."""
        if self.limit is None or not hasattr(engine, "memory_report"):
            return
        for name, nbytes in engine.memory_report():
            program = ProgramMemory(f"generation program {name}", name, self.generation_held, engine=int(nbytes))
            self.programs.append(program)
            require(program, self.limit, self.generation_fixes)

    def table(self) -> str:
        """The compiled programs, one line each (logged at the start of a run)."""
        lines = [f"memory check, {size(self.limit)} a device:"]
        for p in self.programs:
            lines.append(f"  {p.name:<26} {size(p.need):>9}  (held {size(sum(p.held.values()))}, inputs "
                         f"{size(p.inputs)}, outputs {size(p.outputs)}, temporaries {size(p.temp)}"
                         f"{f', engine {size(p.engine)}' if p.engine else ''})")
        return "\n".join(lines)

    def rows(self) -> list[dict]:
        """One row a program: its sizes in GB, the limit and whether it fits."""
        return [{**p.row(), "limit_gb": round(self.limit / GB, 3), "fits": p.need <= FIT_SHARE * self.limit}
                for p in self.programs]


def device_limit(run) -> int | None:
    """The bytes a device may hold: `train.device_memory_limit_bytes`, else XLA's limit on this device (None
    on a CPU); the smallest over the processes of a multi-process run, so that every process decides alike."""
    limit = run.trainer.device_memory_limit_bytes or memory.device_memory_bytes()
    if limit is not None and distributed.process_count() > 1:
        limit = min(distributed.allgather_objects(int(limit)))
    return limit


def plan(run, cfg, build, *, auto_remat: bool = True) -> MemoryPlan:
    """Checks every program of `run`'s step against the device, before any work; returns the plan, with
    `model.remat='auto'` (where `auto_remat`) and an unset log-prob budget resolved.

    Args:
      run: the RunConfig; cfg: its model config (remat "full" where the run says "auto").
      build: (run, cfg) -> an abstract TrainerWorker (`TrainerWorker(..., abstract=True)`).
    Raises:
      DeviceMemoryError: a program that no choice fits, naming it, its sizes and the keys that shrink it.
    """
    limit = device_limit(run)
    if limit is None:  # a CPU without train.device_memory_limit_bytes: nothing to check against
        return MemoryPlan(run, cfg, None)
    t0 = time.perf_counter()
    auto_remat = auto_remat and run.model.remat == "auto"
    w = build(run, cfg)
    remats = [cfg.remat]
    if auto_remat:  # down the ladder from the estimate's first fit (models/remat.py)
        first = memory.first_pass_remat(run, cfg, w.mesh.shape, w.lora, limit)
        remats = list(AUTO_LADDER[AUTO_LADDER.index(first):])
    built = {cfg.remat: StepPrograms(w, limit)}  # by remat: a candidate's abstract worker is built once
    progs = built[cfg.remat]
    # What stays resident alone (exact from the states' shapes): refused here without compiling anything.
    require(ProgramMemory("trainer's resident state", "", progs.held("forward")), limit, progs.fixes("optimizer"))
    for remat in remats:  # the first whose updates fit (the last one is checked below)
        if remat not in built:
            built[remat] = StepPrograms(build(run, cfg.replace(remat=remat)), limit)
        progs = built[remat]
        w = progs.w
        updates = progs.updates()
        if remat == remats[-1] or fits(updates, AUTO_SHARE * limit):
            break
        log.info("model.remat='auto': '%s' does not fit in %.0f%% of %.1f GB (%s)", remat, 100 * AUTO_SHARE,
                 limit / GB, max(updates, key=lambda p: p.need).describe())
    if auto_remat:
        run = dataclasses.replace(run, model=dataclasses.replace(run.model, remat=w.cfg.remat))
        log.info("model.remat='auto': '%s'", w.cfg.remat)
    out = MemoryPlan(run, w.cfg, limit, generation_held=progs.held("generation"),
                     generation_fixes=progs.fixes("generation"))
    for p in updates:
        require(p, limit, progs.fixes("update", p, FIT_SHARE * limit))
    out.programs += updates
    for p in progs.optimizer_and_sync():
        require(p, limit, progs.fixes("sync" if p.name.startswith("weight sync") else "optimizer"))
        out.programs.append(p)
    # The forward passes: the largest budget first, and at each the old and reference passes fused first.
    choices = [(b, f) for b in progs.logprob_budgets() for f in progs.fusions()]
    for budget, fused in choices:  # the first whose passes fit (the last one is checked below)
        forward = progs.forward(budget, fused)
        if (budget, fused) == choices[-1] or fits(forward, AUTO_SHARE * limit):
            break
        log.info("log-prob passes at %d tokens a device%s do not fit in %.0f%% of %.1f GB (%s)", budget,
                 " in one program" if fused else "", 100 * AUTO_SHARE, limit / GB,
                 max(forward, key=lambda p: p.need).describe())
    rollout = run.rollout
    if rollout.log_prob_max_token_len_per_gpu is None and budget != choices[0][0]:
        rollout = dataclasses.replace(rollout, log_prob_max_token_len_per_gpu=budget)
    if rollout.fuse_log_prob_passes and not fused:
        rollout = dataclasses.replace(rollout, fuse_log_prob_passes=False)
    if rollout is not run.rollout:
        run = out.run = dataclasses.replace(run, rollout=rollout)
    for p in forward:
        require(p, limit, progs.fixes("forward", tokens=budget))
    out.programs += forward
    log.info("%s\n(%d programs compiled in %.0f s)", out.table(), len(out.programs), time.perf_counter() - t0)
    return out


def fits(programs, allowed: float) -> bool:
    return all(p.need <= allowed for p in programs)


def require(program: ProgramMemory, limit: int, fixes: list[str]) -> None:
    """Raises the run's one DeviceMemoryError when `program` does not fit in FIT_SHARE of `limit`."""
    if program.need <= FIT_SHARE * limit:
        return
    raise DeviceMemoryError(
        f"device memory: {program.describe()}; the check allows {FIT_SHARE:.0%} of the {size(limit)} a "
        f"device may use (train.device_memory_limit_bytes, else XLA's limit on the device). To fit it: "
        f"{'; '.join(fixes)}")
