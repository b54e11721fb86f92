"""The training processes' view of a rollout process (an async run over several processes,
trainer/processes/placement.py):
an engine and a rollout stream that look like the local ones to `AsyncRLTrainer`, and whose work runs in the
rollout process (trainer/processes/server.py).

Commands go there as host messages (trainer/processes/channel.py); only the training side's first process sends them,
and every training process reads the replies and the finished groups, in the same order, so their SPMD loops stay equal.
Weights go as shards, by one program over both sides' devices (`WeightSync(side='send')`), right after the command that
makes the rollout process join it.
"""

from __future__ import annotations

import threading

from jaxrl_llm import distributed
from jaxrl_llm.rollout.stream import ThreadFailure
from jaxrl_llm.rollout.weight_sync import WeightSync
from jaxrl_llm.trainer.processes.channel import Channel

CHANNEL = "async"


class RemoteEngine:
    """The engine of the rollout process, driven from the training processes."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.channel = Channel(CHANNEL, readers=distributed.process_count())
        self.sync = WeightSync(cfg, mesh, dtype=cfg.dtype, side="send")
        self.version = 0
        self.synced = False  # the rollout process builds its engine around the first weights it is sent
        self.last_stats: dict = {}
        self.main = distributed.is_main()

    @property
    def pad_id(self) -> int:
        return self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0

    def command(self, *msg) -> None:
        if self.main:
            self.channel.put("cmd", msg)

    def reply(self, kind: str):
        return self.channel.get(f"reply/{kind}")

    def generate(self, prompts, sampling, max_new_tokens_per_row=None, seeds=None):
        self.command("generate", [list(p) for p in prompts], sampling, max_new_tokens_per_row, seeds)
        return self.reply("generate")

    def sync_from(self, actor, version: int, *, stage: bool = False) -> None:
        """The actor's weights to the rollout process, device to device: the engine's (`stage`: its stream's, taken
        at the shards' next boundary) weights of `version`."""
        self.command("stage" if stage else "sync", version, self.sync.plan_of(actor))
        self.sync.from_model_state(actor)
        self.version, self.synced = version, True

    def stop(self) -> None:
        """Ends the rollout process's loop (the end of the run)."""
        self.command("stop")


class RemoteStream(ThreadFailure):
    """A `RolloutStream` in the rollout process: `on_group` runs here, on a receiver thread, for each finished group."""

    def __init__(self, engine: RemoteEngine, sampling, *, capacity: int, on_group, kv: str = "recompute"):
        self.engine, self.on_group = engine, on_group
        self.error: BaseException | None = None
        self.received = 0
        self._posted: int | None = None  # the groups the rollout process had posted when it closed its stream
        self._cond = threading.Condition()
        engine.command("stream_start", sampling, capacity, kv)
        self._thread = threading.Thread(target=self._receive, name="rollout-receiver", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._posted is not None and self.received >= self._posted:
                        return
                g = self.engine.channel.get("group", stop=lambda: self._posted is not None
                                            and self.received >= self._posted)
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
        self.engine.channel.check()

    def submit(self, prompts, metas, *, seed: int, streams=None, max_new_tokens_per_row=None, partial=None) -> None:
        self.check()
        self.engine.command("submit", [list(p) for p in prompts], list(metas), seed,
                            None if streams is None else list(streams), max_new_tokens_per_row, partial)

    def stage_from(self, actor, version: int) -> None:
        """New weights to the stream; each shard there takes them at its next decode boundary."""
        self.engine.sync_from(actor, version, stage=True)

    def _ask(self, kind: str, *args):
        self.engine.command(kind, *args)
        return self.engine.reply(kind)

    def drain(self) -> None:
        self._ask("drain")

    def wait_swapped(self) -> None:
        self._ask("wait_swapped")

    def busy_seconds(self) -> float:
        return self._ask("busy")

    def pause(self) -> dict:
        """Parks the stream's shards and returns the rows in flight, once every group finished before the pause is
        here (in `on_group`'s queue), so a checkpoint finds each group either queued or in flight."""
        flight, posted = self._ask("pause")
        self._wait_received(posted)
        return flight

    def resume(self) -> None:
        self.engine.command("resume")

    def _wait_received(self, posted: int) -> None:
        with self._cond:
            while self.received < posted:
                self.check()
                self._cond.wait(0.5)

    def close(self, abort: bool = False) -> None:
        """Closes the stream there; the groups it finished meanwhile still reach `on_group`."""
        posted = self._ask("stream_close", abort)
        with self._cond:
            self._posted = posted
        self._thread.join()
        if not abort:
            self.check()
