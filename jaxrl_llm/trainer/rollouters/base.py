"""The rollouter's interface, and what a rollouter uses of the trainer.

The loop consumes a rollouter and nothing else of the mode: each step it trains on the batches `take(step)` hands
over (one a local update), calls `sync(step + 1, clock)` once the step's updates are done, asks `checkpoint(save)`
for a checkpoint, validates inside `idle()`, and `close()`s it at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

from jaxrl_llm.rollout import RolloutBatch, SamplingParams
from jaxrl_llm.trainer.config import RunConfig
from jaxrl_llm.trainer.dynamic_sampling import ScoredDraw
from jaxrl_llm.trainer.metrics import Timer
from jaxrl_llm.trainer.roles.protocols import EngineRole
from jaxrl_llm.trainer.rollout_batch import Rollout


class Rollouter(Protocol):
    """How a mode hands the loop its batches and takes the new weights."""

    def take(self, step: int, prompts: list[dict] | None = None) -> Iterator[Rollout]:
        """The batches step `step` trains on, one a local update, each made when the loop asks for it. `prompts`:
        this step's prompt batch drawn by the caller (a synchronous rollouter generates from it; the asynchronous
        ones draw their own, ahead, and refuse one)."""

    def sync(self, version: int, clock: Timer) -> dict[str, float]:
        """The step's updates are done: the actor's weights of `version` go toward the engine, now or at the
        rollouter's next sync point. Returns the step's rollout-side metrics. `clock`: the timer of the step's last
        batch, which a rollouter whose rollout is part of the step (the synchronous one) times its sync into."""

    def checkpoint(self, save: Callable[[dict], None]) -> None:
        """Calls `save(meta)` at the rollouter's next sync point, with what it holds for a resume (`meta["async"]`:
        the batch generated for the next step, the queued groups and the rows in flight)."""

    def idle(self) -> contextlib.AbstractContextManager:
        """A context in which the engine runs nothing of the rollouter's (validation generates on it)."""

    def close(self) -> None:
        """Stops the rollouter's threads and stream (the end of the run, or a failure)."""


class RolloutSource(Protocol):
    """What a rollouter uses of the trainer (trainer/loop.py's `RLTrainer`): the run, its data, its engine, how it
    samples and generates, and its scores."""

    run: RunConfig
    iterator: Iterator[list[dict]]
    engine: EngineRole
    total_steps: int
    global_step: int

    def sampling(self, step: int, *, validate: bool = False, draw: int = 0) -> SamplingParams:
        """The sampling of prompt batch `draw` of `step`."""

    def generate(self, prompts: list[dict], sampling: SamplingParams) -> RolloutBatch:
        """`sampling.n` responses a prompt (the agent loop's trajectories where multi-turn is on)."""

    def rollout(self, prompts: list[dict], step: int, draw: int, timer: Timer) -> Rollout:
        """One prompt batch generated as a synchronous step does (and REMAX's greedy responses)."""

    def score_rollout(self, ro: Rollout, device_done=None) -> ScoredDraw:
        """The scores of a rollout's responses."""


def refuse_prompts(prompts, mode: str) -> None:
    if prompts is not None:
        raise ValueError(f"async_training.mode = {mode!r} draws its own prompts ahead of the trainer; a step takes "
                         "none from its caller (call step(k))")
