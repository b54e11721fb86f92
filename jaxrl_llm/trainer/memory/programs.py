"""The programs of one RL step, compiled for the memory check (trainer/memory/check.py) against an abstract
`TrainerWorker` (its states as ShapeDtypeStructs in their shardings), each with what stays resident
beside it. The inputs have the shapes and shardings of the step's own calls (micro-batches at the full
pack shape, built by `build_micro_batch` itself), so the programs compiled here are the ones the first
step runs, found in JAX's persistent cache."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import jax

from jaxrl_llm.rollout.engine_weights import EngineWeights
from jaxrl_llm.trainer.memory.warm_programs import forward_programs, update_programs

log = logging.getLogger(__name__)

GB = 1e9


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One program's bytes on a device while it runs.

    held: resident bytes beside it, by item; inputs: its inputs that are not resident (the micro-batch, the
    gradient accumulator, a sync's merged kernels); outputs: its new outputs (XLA's outputs less those
    aliased to donated inputs); temp: XLA's temporaries; engine: what an engine reports for its program.
    """

    name: str
    jit_name: str
    held: dict
    inputs: int = 0
    outputs: int = 0
    temp: int = 0
    engine: int = 0
    detail: str = ""

    @property
    def need(self) -> int:
        return sum(self.held.values()) + self.inputs + self.outputs + self.temp + self.engine

    def describe(self) -> str:
        total = sum(self.held.values())
        top = sorted(self.held.items(), key=lambda kv: -kv[1])
        held = ", ".join(f"{k} {size(v)}" for k, v in top if v >= 0.05 * total) or "nothing"
        own = [(self.inputs, "inputs"), (self.outputs, "new outputs"), (self.temp, "XLA temporaries"),
               (self.engine, "the engine's (weights, smallest KV pool, program)")]
        parts = [f"{size(total)} held ({held})"] + [f"{size(v)} {what}" for v, what in own if v >= 1e-3 * self.need]
        about = [f"jit '{self.jit_name}'"] if self.jit_name else []
        about += [self.detail] if self.detail else []
        about = f" ({'; '.join(about)})" if about else ""
        return f"the {self.name}{about} needs {size(self.need)} a device: " + ", ".join(parts)

    def row(self) -> dict:
        gb = lambda v: round(v / GB, 3)
        return {"program": self.name, "jit": self.jit_name, "detail": self.detail, "need_gb": gb(self.need),
                "held_gb": gb(sum(self.held.values())), "inputs_gb": gb(self.inputs),
                "outputs_gb": gb(self.outputs), "temp_gb": gb(self.temp), "engine_gb": gb(self.engine)}


def size(nbytes: float) -> str:
    """Bytes as GB (MB below one GB)."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= GB else f"{nbytes / 1e6:.1f} MB"


def device_bytes(tree) -> int:
    """The bytes one device holds of `tree` (arrays or ShapeDtypeStructs; a leaf without a sharding whole)."""
    total = 0
    for x in jax.tree.leaves(tree):
        sh = getattr(x, "sharding", None)
        shape = x.shape if sh is None else sh.shard_shape(x.shape)
        total += math.prod(shape) * x.dtype.itemsize
    return total


def compiled_memory(name: str, jitted, args: tuple, *, held: dict, transient=(), detail: str = "") -> ProgramMemory:
    """`jitted` compiled for `args` (arrays or ShapeDtypeStructs), with XLA's sizes; `transient`: the inputs
    among `args` (or beside them) that are not resident."""
    t0 = time.perf_counter()
    stats = jitted.lower(*args).compile().memory_analysis()
    log.debug("memory check: compiled %s in %.1f s", name, time.perf_counter() - t0)
    outputs = temp = 0
    if stats is not None:
        outputs = stats.output_size_in_bytes - stats.alias_size_in_bytes
        temp = stats.temp_size_in_bytes
    return ProgramMemory(name, getattr(jitted, "__name__", "?"), dict(held), device_bytes(transient), outputs, temp,
                         detail=detail)




class StepPrograms:
    """The step's programs on the abstract worker `w`, and the device bytes resident beside each.

    Args:
      w: an abstract TrainerWorker (`TrainerWorker(..., abstract=True)`).
      limit: the device's bytes, to size a KV pool that the run keeps through the updates.
    """

    def __init__(self, w, limit: int):
        self.w, self.run, self.limit = w, w.run, limit
        run, actor = w.run, w.actor
        self.resident = {"actor params": device_bytes(actor.state["params"]),
                         "actor optimizer": device_bytes([v for k, v in actor.state.items() if k != "params"]),
                         "frozen base": device_bytes(actor.frozen)}
        if w.ref_params is not None and w.lora is None and not run.trainer.ref_offload:
            self.resident["reference"] = device_bytes(w.ref_params)
        if w.critic is not None:
            self.resident.update({"critic params": device_bytes(w.critic.state["params"]),
                                  "critic optimizer": device_bytes([v for k, v in w.critic.state.items()
                                                                    if k != "params"]),
                                  "critic frozen base": device_bytes(w.critic.frozen)})
        self.resident = {k: v for k, v in self.resident.items() if v}
        self.jax_engine = run.rollout.engine == "jax" and not run.async_training.enabled  # else on its own devices
        self.engine_weights = self.kv_pool = 0
        if self.jax_engine:
            # The engine's own conversion program (EngineWeights.update_weights runs it on every sync).
            engine = EngineWeights(w.cfg, None, mesh=w.mesh, dtype=w.cfg.dtype)
            with jax.set_mesh(w.mesh):
                # a frozen base's experts already in the engine's layout are read in place, not copied
                self.convert, self.engine_params = engine.conversion(actor.engine_params())
                self.engine_weights = device_bytes(jax.eval_shape(self.convert, self.engine_params))
            if not run.rollout.free_cache_engine and run.rollout.kv_cache == "paged":  # the pool stays between calls
                share = int(run.rollout.gpu_memory_utilization * limit) - sum(self.resident.values())
                self.kv_pool = run.rollout.kv_cache_memory_bytes or max(0, share - self.engine_weights)

    # ---- what stays resident -----------------------------------------------------------------------
    def held(self, phase: str) -> dict:
        """Resident bytes by item during `phase`: 'generation' (the engine counts its own weights and pool),
        'forward' (the engine's weights stay), 'update' and 'sync' (they go with rollout.free_cache_engine),
        'convert' (a sync drops the old engine weights before converting the new ones)."""
        held = dict(self.resident)
        if phase == "generation":
            return held
        kept = phase == "forward" or (phase != "convert" and not self.run.rollout.free_cache_engine)
        if self.engine_weights and kept:
            held["engine weights"] = self.engine_weights
        if self.kv_pool:
            held["KV pool"] = self.kv_pool
        return held

    # ---- the programs ----------------------------------------------------------------------------
    def _measure(self, program, held: dict) -> ProgramMemory:
        return compiled_memory(program.name, program.jitted, program.args, held=held, transient=program.transient,
                               detail=program.detail)

    def updates(self) -> list:
        """The grad steps of the actor (and the critic) on one full micro-batch."""
        with jax.set_mesh(self.w.mesh):
            return [self._measure(p, self.held("update")) for p in update_programs(self.w, self.w.pack)]

    def optimizer_and_sync(self) -> list:
        """The optimizer steps, then the weight sync's programs."""
        w, out = self.w, []
        roles = [("actor", w.actor, w.actor_apply)] + ([("critic", w.critic, w.critic_apply)] if w.critic else [])
        with jax.set_mesh(w.mesh):
            for name, role, apply in roles:
                grads = jax.tree.map(lambda x: x, role.state["params"])  # same shapes and shardings
                out.append(compiled_memory(f"{name} optimizer", apply, (role.state, grads),
                                           held=self.held("update"), transient=grads))
            merge = None
            if self.jax_engine and w.actor.quantization == "none":  # an 8-bit base merges inside the conversion
                merge = w.actor.merge_program()
            elif not self.jax_engine and (w.lora is None or self.run.rollout.lora_merge):  # the weights a pool reads
                merge = w.actor.merge_program(w.cfg.dtype)
            merged = 0
            if merge is not None:
                out.append(compiled_memory("weight sync: merge", merge[0], merge[1:], held=self.held("sync")))
                merged = out[-1].outputs
            if self.jax_engine:
                out.append(compiled_memory("weight sync: convert", self.convert, (self.engine_params,),
                                           held={**self.held("convert"), "merged weights": merged}))
        return out

    def logprob_budgets(self) -> list[int]:
        """The log-prob budgets to try: rollout.log_prob_max_token_len_per_gpu, or (unset) twice the
        update's, then the update's."""
        run = self.run
        if run.rollout.log_prob_max_token_len_per_gpu:
            return [run.rollout.log_prob_max_token_len_per_gpu]
        return [2 * run.actor.ppo_max_token_len_per_gpu, run.actor.ppo_max_token_len_per_gpu]

    def fusions(self) -> list[bool]:
        """Whether the old and reference passes run as one program, in the order to try: fused first where the
        run asks for it (rollout.fuse_log_prob_passes) and both passes run."""
        w = self.w
        both = w.needs_old_log_prob() and w.needs_ref
        return [True, False] if both and self.run.rollout.fuse_log_prob_passes else [False]

    def forward(self, budget: int, fused: bool = False) -> list:
        """The forward passes the step runs, on one micro-batch of `budget` tokens a device; `fused`: the old
        and reference passes as one program."""
        with jax.set_mesh(self.w.mesh):
            return [self._measure(p, self.held("forward"))
                    for p in forward_programs(self.w, self.w.pack_shape(budget), fused)]

    # ---- what to change ---------------------------------------------------------------------------
    def fixes(self, phase: str, program=None, allowed: float | None = None, tokens: int | None = None) -> list[str]:
        """The keys that shrink a program of `phase` ('update', 'optimizer', 'forward', 'sync',
        'generation'), most specific first; for an update that does not fit in `allowed` bytes, the token
        budget that would (its temporaries scale with the micro-batch); `tokens`: a forward pass's budget."""
        run, w = self.run, self.w
        out = []
        if phase == "update":
            budget = run.actor.ppo_max_token_len_per_gpu
            hint = ""
            if program is not None and allowed is not None and program.temp:
                # Temporaries grow about linearly with the tokens; a tenth is kept spare for the part that does not.
                tokens = 0.9 * budget * (allowed - (program.need - program.temp)) / program.temp
                rows = int(tokens // run.pack_length)
                hint = (f"; about {rows * run.pack_length} would fit" if rows >= 1 else
                        f"; not even one row of {run.pack_length} tokens fits")
            out.append(f"lower actor.ppo_max_token_len_per_gpu (now {budget}{hint})")
            if w.cfg.remat != "full":
                out.append(f"set model.remat = 'full' (now '{w.cfg.remat}')")
        if phase == "forward":
            out.append(f"lower rollout.log_prob_max_token_len_per_gpu (now {tokens} tokens a device)")
        if phase == "generation":
            out.append("fewer rows or prompt tokens at once (rollout.max_num_seqs, rollout.max_num_batched_tokens)")
        if self.kv_pool or phase == "generation":
            out.append(f"a smaller KV pool (rollout.gpu_memory_utilization, now {run.rollout.gpu_memory_utilization}, "
                       "or rollout.kv_cache_memory_bytes)")
        if self.jax_engine and not run.rollout.free_cache_engine:
            out.append("release the engine's weights and KV pool for the updates (rollout.free_cache_engine = True)")
        if "reference" in self.resident:
            out.append("keep the reference on the host (train.ref_offload = True)")
        if w.lora is None:
            out.append("train adapters, not every weight (model.lora_rank > 0)")
        elif run.model.base_quantization == "none":
            out.append("hold the frozen base in 8 bits (model.base_quantization = 'int8'; a sync then merges it "
                       "layer by layer)")
        shape = w.mesh.shape
        out.append(f"shard over more devices (train.mesh_fsdp = {shape['fsdp']}, train.mesh_tensor = "
                   f"{shape['tensor']}: the states split over both, the engine's weights over mesh_tensor)")
        return out
