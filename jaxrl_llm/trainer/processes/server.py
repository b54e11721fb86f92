"""The rollout process of an async run over several processes (trainer/processes/placement.py): the JAX engine on
this process's devices, serving the training side's calls (a `RolloutService`, processes/service.py), until it says
stop.

One thread makes the calls in order: a weight sync (this process's half of one program over both sides' devices,
`WeightSync(side='receive')`), a batch to generate (one_step_off, validation), or the rollout stream's calls
(fully_async: start, submit, stage new weights, drain, pause and resume for a checkpoint, close). The stream's
shards run on their own threads, as in one process, and post each finished group as it finishes. A failure here
is posted to the training side (its next wait raises it) and raised, so the process exits non-zero and the
launcher or the Ray driver stops the run with one line.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import jax

from jaxrl_llm.agent.config import engine_prompt_length
from jaxrl_llm.rollout import make_jax_engine
from jaxrl_llm.rollout.stream import RolloutStream
from jaxrl_llm.rollout.weight_sync import WeightSync
from jaxrl_llm.trainer.processes.channel import Channel
from jaxrl_llm.trainer.processes.placement import rollout_mesh, split_devices
from jaxrl_llm.trainer.processes.service import CHANNEL, serve
from jaxrl_llm.trainer.roles.model_load import model_config

log = logging.getLogger(__name__)


class RolloutServer:
    """The engine of an async run's rollout process; a `RolloutService`."""

    def __init__(self, run):
        self.run = run
        self.cfg = model_config(run)
        _, devices = split_devices(run)
        self.mesh = rollout_mesh(run, [d for d in devices if d.process_index == jax.process_index()])
        self.channel = Channel(CHANNEL)
        self.weight_sync = WeightSync(self.cfg, self.mesh, dtype=self.cfg.dtype, side="receive")
        self.engine = None
        self.stream: RolloutStream | None = None
        self.posted = 0  # groups the current stream has posted
        self.stopped = False
        self._lock = threading.Lock()

    def serve(self) -> dict:
        try:
            serve(self, self.channel)
            return {}
        except BaseException as e:
            self.channel.fail(f"the rollout process failed: {type(e).__name__}: {e}")
            raise
        finally:
            if self.stream is not None:
                self.stream.close(abort=True)

    def stop(self) -> None:
        self.stopped = True

    # ---- weights and one-step-off batches ------------------------------------------------------------
    def sync(self, version: int, plan: dict) -> None:
        params = self.weight_sync.from_plan(plan)
        if self.engine is None:  # the first weights: the engine is built around them
            r = self.run
            self.engine = make_jax_engine(self.cfg, None, self.mesh,
                                          rollout=dataclasses.replace(r.rollout, free_cache_engine=False),
                                          max_prompt_length=engine_prompt_length(r),
                                          max_model_len=r.rollout.max_model_len or r.max_model_len)
        self.engine.update_weights(params, step=version)

    def generate(self, prompts, sampling, max_new_tokens_per_row, seeds):
        return self.engine.generate(prompts, sampling, max_new_tokens_per_row=max_new_tokens_per_row, seeds=seeds)

    # ---- the rollout stream (fully_async) ------------------------------------------------------------
    def _post(self, group) -> None:  # on a shard's thread
        with self._lock:  # counted first: a pause's count covers every group posted or being posted
            self.posted += 1
        self.channel.put("group", group)

    def stream_start(self, sampling, capacity: int, kv: str) -> None:
        self.posted = 0
        self.stream = RolloutStream(self.engine, sampling, capacity=capacity, on_group=self._post, kv=kv)

    def submit(self, prompts, metas, seed, streams, max_new_tokens_per_row, partial) -> None:
        self.stream.submit(prompts, metas, seed=seed, streams=streams, max_new_tokens_per_row=max_new_tokens_per_row,
                           partial=partial)

    def stage(self, version: int, plan: dict) -> None:
        self.stream.stage_weights(self.weight_sync.from_plan(plan), version)

    def drain(self) -> None:
        self.stream.drain()

    def wait_swapped(self) -> None:
        self.stream.wait_swapped()

    def busy(self) -> float:
        return self.stream.busy_seconds()

    def pause(self) -> tuple[dict, int]:
        return self.stream.pause(), self.posted

    def resume(self) -> None:
        self.stream.resume()

    def stream_close(self, abort: bool) -> int:
        stream, self.stream = self.stream, None
        stream.close(abort=abort)
        return self.posted
