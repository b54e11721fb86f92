"""The rollout process's interface (`RolloutService`), and how its calls cross from the training processes.

The training side holds a proxy of the service (roles/handles.py) whose transport is the host channel
(`ChannelTransport`): only the training side's first process sends a call, as a message on the "cmd" topic; a call
that returns something then waits for its reply, which every training process reads (their SPMD loops stay
equal). A `@oneway` call goes without a reply. The rollout process reads the calls in order and makes each on its
server through `serve`. Weights never go this way: `sync` and `stage` carry the plan of the program over both
sides' devices that moves them (rollout/weight_sync.py), which both sides then run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from jaxrl_llm import distributed
from jaxrl_llm.rollout import RolloutBatch, SamplingParams
from jaxrl_llm.trainer.processes.channel import Channel
from jaxrl_llm.trainer.roles.handles import dispatch, is_oneway, oneway

CHANNEL = "async"


class RolloutService(Protocol):
    """What the rollout process does for the training side (processes/server.py)."""

    @oneway
    def sync(self, version: int, plan: dict) -> None:
        """Joins the weight program of `plan`; the engine takes its weights as `version` (the first build it)."""

    @oneway
    def stage(self, version: int, plan: dict) -> None:
        """Joins the weight program of `plan`; the stream's shards take the weights at their next boundary."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 max_new_tokens_per_row: Sequence[int] | None, seeds: Sequence[int] | None) -> RolloutBatch:
        """One rollout (one_step_off, validation)."""

    @oneway
    def stream_start(self, sampling: SamplingParams, capacity: int, kv: str) -> None:
        """Starts a rollout stream; its finished groups go to the "group" topic as they finish."""

    @oneway
    def submit(self, prompts: list[list[int]], metas: list, seed: int, streams: list[int] | None,
               max_new_tokens_per_row: Sequence[int] | None, partial: dict | None) -> None:
        """Prompts into the stream."""

    def drain(self) -> None:
        """Returns once the stream has no row in flight."""

    def wait_swapped(self) -> None:
        """Returns once every shard runs the staged weights."""

    def busy(self) -> float:
        """The stream's seconds with rows in flight, so far."""

    def pause(self) -> tuple[dict, int]:
        """Parks the stream's shards: (the rows in flight, the groups posted so far)."""

    @oneway
    def resume(self) -> None:
        """The parked shards go on."""

    def stream_close(self, abort: bool) -> int:
        """Closes the stream; returns the groups it posted."""

    @oneway
    def stop(self) -> None:
        """The end of the run: the process's loop returns."""


class ChannelTransport:
    """Calls to the rollout process over the host channel (see the module docstring)."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.main = distributed.is_main()

    def __call__(self, name: str, args: tuple, kwargs: dict):
        if self.main:
            self.channel.put("cmd", (name, args, kwargs))
        if not is_oneway(RolloutService, name):
            return self.channel.get(f"reply/{name}")
        return None


def serve(server, channel: Channel) -> None:
    """Makes the calls the training side sends, in order, on `server`, replying where the caller waits, until a call
    sets `server.stopped`."""
    while not server.stopped:
        name, args, kwargs = channel.get("cmd")
        result = dispatch(server, RolloutService, name, args, kwargs)
        if not is_oneway(RolloutService, name):
            channel.put(f"reply/{name}", result)
