"""The step's programs at every shape a step can give them, with the arguments they will be called with, and
their compilation before the first step (`train.compile_ahead`), so that no later step compiles.

The data reaches a program's shapes only through the packing (trainer/packing.py): the update's grad steps run
on the shapes of the update's ladder, the forward passes (old and reference log-probs, fused or apart, the
critic's values, clip_cov / kl_cov's current log-probs) on those of the log-prob ladder. Every other program
of a step has one shape a run (the optimizer, the advantages over [R, Tr], the zeros of the accumulators) and
step 0 compiles it. `update_programs` and `forward_programs` list them for one shape, with ShapeDtypeStructs in
the shardings the step places its arrays with (the memory check compiles the full shapes of the same lists,
trainer/memory/programs.py); `CompileAhead` lowers and compiles every pair of program and ladder shape on a
thread pool. jax keeps each executable with its jitted function, so the step's later calls at those shapes
run it without tracing or compiling again (and each executable lands in the persistent compilation cache).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import sharding
from jaxrl_llm.algorithms import LossNorm
from jaxrl_llm.trainer import router_replay
from jaxrl_llm.trainer.batch import PackShape, TrainBatch, build_micro_batch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Program:
    """One jitted program of the step with the arguments of one of its calls (ShapeDtypeStructs or small
    arrays); `transient`: those arguments that are not resident (what the memory check adds to the held state)."""

    name: str
    jitted: object
    args: tuple
    transient: tuple = ()
    detail: str = ""


def abstract(tree):
    """ShapeDtypeStructs in the arrays' shardings (a leaf that already is one stays)."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else
                        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def micro_batch(w, pack: PackShape, fields, *, update: bool) -> tuple[dict, dict]:
    """A micro-batch of `pack`'s shape as the worker places it (`_put`): (host arrays, ShapeDtypeStructs)."""
    run, tr = w.run, pack.resp_len
    batch = TrainBatch(prompt_ids=[np.ones(1, np.int32)], responses=np.zeros((1, tr), np.int32),
                       response_mask=np.ones((1, tr), np.float32), group_ids=np.zeros(1, np.int32),
                       fields={k: np.zeros((1, tr), np.float32) for k in fields})
    mode = run.router_replay.mode
    if w.cfg.is_moe and (mode == "R3" or (mode == "R2" and update)):  # the routing the passes replay
        k, layers = w.cfg.num_experts_per_tok, len(w.cfg.sparse_layers)  # L_moe: every stack's sparse layers
        width = run.data.max_prompt_length + tr
        batch.fields[router_replay.FIELD] = np.zeros((1, width, layers, k), np.int16)
    host = build_micro_batch(batch, [(0, 0, 0)], pack, fields=tuple(fields), pad_id=0)
    host = {k: v for k, v in host.items() if k not in ("seq_ids", "seq_start")}
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding.batch_sharding(w.mesh, v.ndim, v.shape))
              for k, v in host.items()}
    return host, shapes


def update_programs(w, pack: PackShape) -> list[Program]:
    """The grad steps of the actor (and the critic) on one micro-batch of `pack`'s shape."""
    fields = {"rollout_log_probs"}  # what a sampled batch carries besides the fields the update computes
    if w.rc is not None and not w.bypass:  # decoupled rollout correction
        fields |= {"loss_mask", "rollout_is_weights"}
    out = [_grad("actor update", w, pack, w.actor, w.actor_grad, w.actor_metrics0, w.actor_zeros,
                 w.actor_update_fields(fields))]
    if w.critic is not None:
        out.append(_grad("critic update", w, pack, w.critic, w.critic_grad, w.critic_metrics0, w.critic_zeros,
                         ["values", "returns"]))
    return out


def _grad(name, w, pack, role, grad_fn, metrics0, zeros, fields) -> Program:
    host, mb = micro_batch(w, pack, fields, update=True)
    params = abstract(role.state["params"])
    with jax.set_mesh(w.mesh):  # the loss's scalars as the update makes them, on the mesh
        norm = LossNorm(jnp.float32(1.0), jnp.float32(1.0), jnp.float32(1.0))
        grads = jax.eval_shape(zeros, params)
        metrics = metrics0(role.params(params), host, norm)
    return Program(name, grad_fn, (params, abstract(role.frozen), grads, metrics, mb, norm),
                   transient=(grads, metrics, mb),
                   detail=f"remat '{role.cfg.remat}', {pack.rows} rows of {pack.length} tokens")


def forward_programs(w, pack: PackShape, fused: bool) -> list[Program]:
    """The forward passes the step runs on one micro-batch of `pack`'s shape; `fused`: the old and reference
    log-prob passes as one program."""
    _, mb = micro_batch(w, pack, (), update=False)
    detail, out = f"{pack.rows} rows of {pack.length} tokens", []
    actor = abstract(w.actor.params())
    ref = offloaded = ()
    if w.needs_ref:
        offloaded = w.lora is None and w.run.trainer.ref_offload  # on the host: brought back for its pass
        # An offloaded reference comes back in the base's shardings (`distributed.from_host_shards`).
        ref = (jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), w.ref_params,
                            w.actor.base_sh) if offloaded and not w.actor.abstract else abstract(w.ref_params))
    ref_in = ref if offloaded else ()
    if fused:
        out.append(Program("old + reference log-prob pass", w.old_ref_fn, (*w.old_ref_params(actor, ref), mb),
                           (mb, ref_in), detail))
    else:
        if w.needs_old_log_prob():
            out.append(Program("old log-prob pass", w.logprob_fn, (actor, mb), (mb,), detail))
        if w.needs_ref:
            out.append(Program("reference log-prob pass", w.ref_logprob_fn, (ref, mb), (mb, ref_in), detail))
    if w.critic is not None:
        out.append(Program("critic values pass", w.value_fn, (abstract(w.critic.params()), mb), (mb,), detail))
    if w.cov_select is not None:  # clip_cov / kl_cov: the current policy's log-probs over each mini-batch
        out.append(Program("current log-prob pass", w.plain_logprob_fn, (actor, mb), (mb,), detail))
    return out


def step_programs(w) -> list[Program]:
    """Every program of `w`'s step whose shapes depend on the data, at every shape of its ladder."""
    fused = w.needs_old_log_prob() and w.needs_ref and w.run.rollout.fuse_log_prob_passes
    return ([p for pack in w.pack_ladder for p in update_programs(w, pack)]
            + [p for pack in w.fwd_ladder for p in forward_programs(w, pack, fused)])


class CompileAhead:
    """Compiles `step_programs(w)` on a pool of threads (XLA compiles outside Python's lock), from construction
    on; `wait()` returns once all are built (raising the first failure) with how many and the seconds taken."""

    def __init__(self, w, threads: int | None = None):
        self.programs = step_programs(w)
        self._t0 = time.perf_counter()
        threads = threads or max(1, min(len(self.programs), os.cpu_count() or 1, 8))
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile_ahead")
        self._futures = [self._pool.submit(self._build, w.mesh, p) for p in self.programs]

    @staticmethod
    def _build(mesh, p: Program) -> None:
        with jax.set_mesh(mesh):  # as the step calls it (the mesh context is a part of the program)
            p.jitted.lower(*p.args).compile()

    def wait(self) -> tuple[int, float]:
        try:
            for f in self._futures:
                f.result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
        return len(self.programs), time.perf_counter() - self._t0
