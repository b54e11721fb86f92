"""The rollouters: how each mode hands the trainer its batches and takes its new weights.

A rollouter stands between the loop and the engine. The loop only consumes it (rollouters/base.py): each step it
trains on the batches `take(step)` hands over, one a local update, and then calls `sync(version)`; a checkpoint is
written when `checkpoint(save)` says (at the rollouter's next sync point, with what it holds for a resume);
validation runs inside `idle()`; `close()` stops it. What differs between the modes lives here, each in a room of
its own:

* `sync.py` (`async_training.mode = 'sync'`): generation is part of the step, on the trainer's thread and devices
  (with DAPO's dynamic sampling, drawn and scored until the varying groups fill the batch); the weights go to the
  engine right after the update, in the step's clock.
* `one_step_off.py`: a rollout thread generates the next batch on the rollout's own devices while the trainer
  updates on this one; the engine takes new weights at the next step's start.
* `fully_async.py`: a rollout stream generates without stopping, fed within a staleness bound; the trainer takes
  finished groups as they come, and the weights swap in at the shards' next decode boundary.

`state.py` holds what the asynchronous modes share: rollouts built from streamed groups, the staleness and overlap
metrics, and the packing of a checkpoint's state into its JSON meta. The engine a rollouter drives is a role
(trainer/roles/): in this process, or in another one (trainer/processes/remote.py) with the same calls.
"""

from __future__ import annotations

from jaxrl_llm.trainer.rollouters.base import Rollouter, RolloutSource
from jaxrl_llm.trainer.rollouters.fully_async import FullyAsync
from jaxrl_llm.trainer.rollouters.one_step_off import OneStepOff
from jaxrl_llm.trainer.rollouters.sync import DynamicSampling, SyncRollouter


def make_rollouter(trainer: RolloutSource, resumed_meta: dict | None = None) -> Rollouter:
    """The rollouter of the run's `async_training.mode`, resuming from a checkpoint's state of the same mode."""
    run = trainer.run
    mode = run.async_training.mode
    saved = (resumed_meta or {}).get("async")
    saved = saved if saved and saved.get("mode") == mode else None
    if mode == "one_step_off":
        return OneStepOff(trainer, saved)
    if mode == "fully_async":
        return FullyAsync(trainer, saved)
    return DynamicSampling(trainer) if run.filter_groups.enable else SyncRollouter(trainer)


__all__ = ["DynamicSampling", "FullyAsync", "OneStepOff", "Rollouter", "RolloutSource", "SyncRollouter",
           "make_rollouter"]
