"""The JAX engine as a rollout role (`EngineRole`), in the places a run puts it.

* `ColocatedEngine` (the synchronous mode): the engine on the training mesh. A sync reads the actor's weights in
  place (the engine's layout of them, cast to the compute dtype); under `rollout.free_cache_engine` the engine
  gives that copy back before each update (the worker calls `free_for_update`: it shares the worker's devices),
  as it gives back its KV pool after each rollout, and the next sync rebuilds it.
* `SplitEngine` (one_step_off, fully_async in one process): the engine on the rollout's own devices. Weights
  cross by a `WeightSync`, device to device in layer buckets; under LoRA the frozen base crosses once (the
  engine's first weights come through that same sync) and each later sync moves the adapters alone. It runs the
  fully_async rollout stream over its shards.
* `RemoteEngine` (processes/remote.py): the engine of another process, for an async run over several processes.

`make_engine` picks one for the run's placement and builds it beside the worker, in the worker's process: the
engine reads the actor's state (its `ModelState`) and counts in the worker's memory check.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax

from jaxrl_llm import distributed
from jaxrl_llm.agent.config import engine_prompt_length
from jaxrl_llm.rollout import RolloutError, SamplingParams, make_jax_engine
from jaxrl_llm.rollout.stream import RolloutStream
from jaxrl_llm.rollout.weight_sync import WeightSync
from jaxrl_llm.trainer.processes.placement import rollout_mesh
from jaxrl_llm.trainer.processes.remote import RemoteEngine

if TYPE_CHECKING:
    from jaxrl_llm.trainer.roles.worker import TrainerWorker


def training_sampling(run, seed: int) -> SamplingParams:
    """How the trainer samples its training rollouts (`seed`: the draw's own)."""
    r = run.rollout
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=run.data.max_response_length, seed=seed, ignore_eos=r.ignore_eos,
                          return_routed_experts=run.router_replay.mode == "R3")


class JaxEngineRole:
    """What both JAX engine roles in this process share: `sampler` is the JAX engine, `actor` the worker's."""

    def __init__(self, sampler, actor):
        self.sampler, self.actor = sampler, actor

    def generate(self, prompts, sampling, max_new_tokens_per_row=None, seeds=None):
        return self.sampler.generate(prompts, sampling, max_new_tokens_per_row=max_new_tokens_per_row, seeds=seeds)

    def generate_on_main(self, prompts, sampling, max_new_tokens_per_row=None, seeds=None):
        if distributed.process_count() > 1:  # every process drives its shards: no process can generate alone
            raise RolloutError("the JAX engine generates on every process of a run together; a call from process 0 "
                               "alone (multi-turn rollouts) needs rollout.engine = 'vllm'")
        return self.generate(prompts, sampling, max_new_tokens_per_row, seeds)

    def warm(self, run) -> None:
        """Builds the programs of the run's training rollouts (data.train_batch_size prompts x rollout.n rows a
        call) before the first (`JaxEngine.warm`); the dense engine builds as it goes."""
        warm = getattr(self.sampler, "warm", None)
        if warm is not None:
            warm(training_sampling(run, seed=0), run.data.train_batch_size * run.rollout.n)

    def start(self, version: int) -> None:
        if version:  # restored: the engine was built with the starting weights (step 0's); the restored ones go in
            self.sync(version)

    def sync(self, version: int) -> None:
        self.sampler.update_weights(self.weights(), step=version)
        jax.block_until_ready(self.sampler.params)

    def weights(self) -> dict:
        raise NotImplementedError

    def stats(self) -> dict:
        return getattr(self.sampler, "last_stats", None) or {}  # (the dense engine keeps none)


class ColocatedEngine(JaxEngineRole):
    """The JAX engine on the training mesh, reading the actor's weights in place."""

    def __init__(self, sampler, actor, *, free_cache: bool):
        super().__init__(sampler, actor)
        self.free_cache = free_cache

    def weights(self) -> dict:
        return self.actor.engine_params()

    def free_for_update(self) -> None:
        """Gives its weight copy back to the update (`rollout.free_cache_engine`); the next sync rebuilds it."""
        if self.free_cache:
            self.sampler.release_weights()

    def weight_sync_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass  # its pools went after its last rollout; its weights are views the trainer's arrays outlive


class SplitEngine(JaxEngineRole):
    """The JAX engine on the rollout's own devices; weights cross by `weight_sync`."""

    def __init__(self, sampler, actor, weight_sync: WeightSync):
        super().__init__(sampler, actor)
        self.weight_sync = weight_sync

    @property
    def version(self) -> int:
        return self.sampler.version

    @property
    def pad_id(self) -> int:
        return self.sampler.pad_id

    def weights(self) -> dict:
        return self.weight_sync.from_model_state(self.actor)

    def weight_sync_metrics(self) -> dict[str, float]:
        sync = self.weight_sync
        return {"rollouter/weight_sync_mb": sync.stats.bytes / 2**20,
                "rollouter/weight_sync_cross_process": float(sync.side is not None)}

    def stream(self, sampling, *, capacity: int, on_group, kv: str) -> RolloutStream:
        return RolloutStream(self.sampler, sampling, capacity=capacity, on_group=on_group, kv=kv)

    def stage(self, stream: RolloutStream, version: int) -> None:
        stream.stage_weights(self.weights(), version)

    def close(self) -> None:
        """Frees the rollout devices now (KV pools, weights, LoRA's base kept by the sync), not whenever the trainer
        is collected: a second trainer in this process (a benchmark's next mode) sizes its pools from what is free."""
        self.sampler.release()
        self.sampler.release_weights()
        self.weight_sync.drop_base()


def make_engine(worker: TrainerWorker):
    """The JAX engine role of the worker's run, built beside `worker` in its process: it reads the actor's weights,
    counts in the worker's memory check, and on the training devices gives its weights back for each update."""
    run, cfg, actor, memory = worker.run, worker.cfg, worker.actor, worker.memory
    kw = dict(max_prompt_length=engine_prompt_length(run), max_model_len=run.rollout.max_model_len or run.max_model_len)
    rollout_devices = worker.rollout_devices
    if rollout_devices is None:
        sampler = make_jax_engine(cfg, actor.engine_params(), worker.mesh, rollout=run.rollout, **kw)
        memory.check_engine(sampler)  # the sampler's programs, where the engine reports them
        engine = ColocatedEngine(sampler, actor, free_cache=run.rollout.free_cache_engine)
        worker.share_devices(engine)
        return engine
    # The rollout's own devices: nothing of the trainer's there, and no update to give the KV pool to.
    memory.generation_held = {}
    mesh = rollout_mesh(run, rollout_devices)
    if any(d.process_index != jax.process_index() for d in rollout_devices):
        return RemoteEngine(cfg, mesh, actor)  # another process's (processes/placement.py), driven from here
    # The engine's first weights come through the sync every later one takes: under LoRA the frozen base moves here,
    # once, and each sync after moves the adapters alone (the merged model built on the training devices and moved
    # whole, then the base again at the first sync, was two moves).
    weight_sync = WeightSync(cfg, mesh, dtype=cfg.dtype)
    sampler = make_jax_engine(cfg, weight_sync.from_model_state(actor), mesh,
                              rollout=dataclasses.replace(run.rollout, free_cache_engine=False), **kw)
    memory.check_engine(sampler)
    return SplitEngine(sampler, actor, weight_sync)
