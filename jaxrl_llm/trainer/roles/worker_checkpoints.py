"""The checkpoint side of `TrainerWorker` (trainer/roles/worker.py): opening the run's checkpoint dir, saving and
restoring the train states, and setting aside another run's checkpoints."""

from __future__ import annotations

import os


class WorkerCheckpoints:
    """Mixin of TrainerWorker: uses its `actor_state` and `critic_state`."""

    def set_aside_checkpoints(self) -> list[str]:
        """A fresh start in a run dir that has checkpoints moves them aside (they are another run's)."""
        return self.ckpt.set_aside_after(0)

    def open_checkpointer(self, directory: str, max_to_keep: int | None) -> list[int]:
        """Opens the run's checkpoint dir for saving; returns the steps already there."""
        from jaxrl_llm.checkpoint import RunCheckpointer

        self.ckpt = RunCheckpointer(directory, max_to_keep=max_to_keep)
        return self.ckpt.steps()

    def close_checkpointer(self) -> None:
        """Waits for pending saves and stops the checkpoint manager's threads."""
        self.ckpt.close()

    def save_checkpoint(self, step: int, meta: dict) -> dict[str, float]:
        """Starts an async save of the train states (the device-to-host copy happens here, the disk writes on
        Orbax's thread) once the previous one has committed; returns the disk usage of the committed ones."""
        return self.ckpt.save(step, actor=self.actor_state, critic=self.critic_state, meta=meta)

    def wait_checkpoint(self) -> None:
        self.ckpt.wait()

    def restore_checkpoint(self, directory: str, step: int | None = None) -> dict | None:
        """Restores train states into this worker's mesh layout; returns the checkpoint's meta (with
        its step), or None when `directory` has no checkpoint. (The engine takes the restored weights when the
        trainer starts it: `EngineRole.start`.)"""
        from jaxrl_llm.checkpoint import NoValidCheckpointError, RunCheckpointer

        own = self.ckpt
        ckpt = own if own.directory == os.path.abspath(directory) else \
            RunCheckpointer(directory, read_only=True) if os.path.isdir(directory) else None
        if ckpt is None:
            own.set_aside_after(0)
            return None
        if step is None:
            found = ckpt.restore_latest_valid(actor=self.actor_state, critic=self.critic_state)
            if found is None:
                own.set_aside_after(0)
                return None
            step, actor, critic, meta = found
        else:
            if step not in ckpt.steps():
                raise NoValidCheckpointError(f"{directory}: no checkpoint for step {step}; it has {ckpt.steps()}")
            actor, critic, meta = ckpt.restore(step, actor=self.actor_state, critic=self.critic_state)
        self.actor_state = actor
        if critic is not None:
            self.critic_state = critic
        own.set_aside_after(step)
        return {**meta, "step": step}
