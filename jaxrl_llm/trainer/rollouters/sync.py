"""The synchronous mode (`async_training.mode = 'sync'`): the rollout is part of the step, on the trainer's thread.

Each step draws a prompt batch, generates it (and, for REMAX, one greedy response a prompt), trains on it, and
then moves the new weights to the engine (`timing_s/reshard`), all in the step's clock. With DAPO's dynamic
sampling on (`algorithm.filter_groups`), `DynamicSampling` draws, generates and scores prompt batches until the
groups whose filter metric varies fill `data.train_batch_size` prompts (trainer/dynamic_sampling.py), and hands
over that batch scored: the loop then runs the passes on it alone (it is only known after scoring, so nothing
overlaps the reward).
"""

from __future__ import annotations

import contextlib
import itertools

from jaxrl_llm.trainer.dynamic_sampling import GroupFilter
from jaxrl_llm.trainer.metrics import Timer
from jaxrl_llm.trainer.rollout_batch import Rollout
from jaxrl_llm.trainer.rollouters.base import RolloutSource


class SyncRollouter:
    """Generation in the step; the weights go to the engine right after the step's update."""

    def __init__(self, trainer: RolloutSource):
        self.trainer = trainer

    def take(self, step: int, prompts: list[dict] | None = None):
        t = self.trainer
        prompts = next(t.iterator) if prompts is None else prompts
        timer = Timer()
        with timer("step"):
            ro = t.rollout(prompts, step, 0, timer)
        ro.timer = timer
        yield ro

    def sync(self, version: int, clock: Timer) -> dict[str, float]:
        with clock("step"), clock("reshard"):
            self.trainer.engine.sync(version)
        return {}

    def checkpoint(self, save) -> None:
        save({})

    def idle(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class DynamicSampling(SyncRollouter):
    """The synchronous mode with DAPO's dynamic sampling: a step's batch is the varying groups of as many draws as
    fill it, scored."""

    def take(self, step: int, prompts: list[dict] | None = None):
        t = self.trainer
        first = prompts = next(t.iterator) if prompts is None else prompts
        groups = GroupFilter(t.run.filter_groups, t.run.data.train_batch_size)
        timer = Timer()
        with timer("step"):
            for draw in itertools.count():
                if draw:
                    groups.check_budget()
                    prompts = next(t.iterator)  # the checkpoint's iterator state covers every draw
                ro = t.rollout(prompts, step, draw, timer)
                with timer("reward"):
                    groups.add(t.score_rollout(ro))
                if groups.full:
                    break
        scored = groups.result()
        scored.exposed_s = timer.times["reward"]
        yield Rollout(scored.batch, [], prompts=first, timer=timer, metrics=groups.metrics(), scored=scored)
