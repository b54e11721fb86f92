"""The training processes' view of a rollout process (an async run over several processes,
trainer/processes/placement.py): an engine role and a rollout stream that look like the local ones
(roles/engines.py's `SplitEngine`, rollout/stream.py's `RolloutStream`) to the rollouters, and whose work runs in
the rollout process (trainer/processes/server.py).

Their calls go to the rollout process as calls on a `RolloutService` proxy (processes/service.py): host messages
that only the training side's first process sends, whose replies and finished groups every training process reads,
in the same order, so that their SPMD loops stay equal. Weights go as shards, by one program over both sides'
devices (`WeightSync(side='send')`), right after the call that makes the rollout process join it.
"""

from __future__ import annotations

import threading

from jaxrl_llm import distributed
from jaxrl_llm.rollout.stream import ThreadFailure
from jaxrl_llm.rollout.weight_sync import WeightSync
from jaxrl_llm.trainer.processes.channel import Channel
from jaxrl_llm.trainer.processes.service import CHANNEL, ChannelTransport, RolloutService
from jaxrl_llm.trainer.roles.handles import proxy


class RemoteEngine:
    """The engine of the rollout process, driven from the training processes; it takes the weights of `actor`."""

    def __init__(self, cfg, mesh, actor):
        self.cfg, self.mesh, self.actor = cfg, mesh, actor
        self.channel = Channel(CHANNEL, readers=distributed.process_count())
        self.service: RolloutService = proxy(RolloutService, ChannelTransport(self.channel))
        self.weight_sync = WeightSync(cfg, mesh, dtype=cfg.dtype, side="send")
        self.version = 0
        self.synced = False  # the rollout process builds its engine around the first weights it is sent

    @property
    def pad_id(self) -> int:
        return self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0

    def generate(self, prompts, sampling, max_new_tokens_per_row=None, seeds=None):
        if not self.synced:  # a rollout before any sync (validation before the first step): the weights go first
            self.sync(self.version)
        return self.service.generate([list(p) for p in prompts], sampling, max_new_tokens_per_row, seeds)

    def generate_on_main(self, prompts, sampling, max_new_tokens_per_row=None, seeds=None):
        raise NotImplementedError("an async run over several processes serves no multi-turn rollouts")

    def start(self, version: int) -> None:
        if version:  # restored: the rollout process gets the restored weights (else its first sync brings step 0's)
            self.sync(version)

    def sync(self, version: int) -> None:
        """The actor's weights to the rollout process's engine, device to device, as `version`."""
        self._send_weights(version, self.service.sync)

    def _send_weights(self, version: int, call) -> None:
        call(version, self.weight_sync.plan_of(self.actor))  # the rollout process joins the program ...
        self.weight_sync.from_model_state(self.actor)  # ... that this side runs now
        self.version, self.synced = version, True

    def stats(self) -> dict:
        return {}

    def weight_sync_metrics(self) -> dict[str, float]:
        return {"rollouter/weight_sync_mb": self.weight_sync.stats.bytes / 2**20,
                "rollouter/weight_sync_cross_process": float(self.weight_sync.side is not None)}

    def stream(self, sampling, *, capacity: int, on_group, kv: str = "recompute") -> RemoteStream:
        return RemoteStream(self, sampling, capacity=capacity, on_group=on_group, kv=kv)

    def stage(self, stream: RemoteStream, version: int) -> None:
        """New weights to the stream; each shard there takes them at its next decode boundary."""
        self._send_weights(version, self.service.stage)

    def close(self) -> None:
        """Ends the rollout process's loop (the end of the run)."""
        self.service.stop()


class RemoteStream(ThreadFailure):
    """A `RolloutStream` in the rollout process: `on_group` runs here, on a receiver thread, for each finished group."""

    def __init__(self, engine: RemoteEngine, sampling, *, capacity: int, on_group, kv: str = "recompute"):
        self.engine, self.on_group = engine, on_group
        self.service, self.channel = engine.service, engine.channel
        self.error: BaseException | None = None
        self.received = 0
        self._posted: int | None = None  # the groups the rollout process had posted when it closed its stream
        self._cond = threading.Condition()
        self.service.stream_start(sampling, capacity, kv)
        self._thread = threading.Thread(target=self._receive, name="rollout-receiver", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._posted is not None and self.received >= self._posted:
                        return
                g = self.channel.get("group", stop=lambda: self._posted is not None and self.received >= self._posted)
                if g is None:
                    return
                self.on_group(g)
                with self._cond:
                    self.received += 1
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 (the trainer's thread raises it: `check`)
            self.fail(e)

    def check(self) -> None:
        super().check()
        self.channel.check()

    def submit(self, prompts, metas, *, seed: int, streams=None, max_new_tokens_per_row=None, partial=None) -> None:
        self.check()
        self.service.submit([list(p) for p in prompts], list(metas), seed, None if streams is None else list(streams),
                            max_new_tokens_per_row, partial)

    def drain(self) -> None:
        self.service.drain()

    def wait_swapped(self) -> None:
        self.service.wait_swapped()

    def busy_seconds(self) -> float:
        return self.service.busy()

    def pause(self) -> dict:
        """Parks the stream's shards and returns the rows in flight, once every group finished before the pause is
        here (in `on_group`'s queue), so a checkpoint finds each group either queued or in flight."""
        flight, posted = self.service.pause()
        with self._cond:
            while self.received < posted:
                self.check()
                self._cond.wait(0.5)
        return flight

    def resume(self) -> None:
        self.service.resume()

    def close(self, abort: bool = False) -> None:
        """Closes the stream there; the groups it finished meanwhile still reach `on_group`."""
        posted = self.service.stream_close(abort)
        with self._cond:
            self._posted = posted
        self._thread.join()
        if not abort:
            self.check()
