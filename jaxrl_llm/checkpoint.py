"""Orbax checkpoints of a run, with resume that is exact and survives a bad latest checkpoint.

A checkpoint `<run_dir>/checkpoints/<step>/` holds three items:
  actor   params, optimizer state, update counters (sharded arrays; restored into the current mesh's
          layout, whatever mesh saved them)
  critic  the same for the critic (PPO only)
  meta    JSON: the step, the data iterator state, the KL controller state, the sampling seed, the
          model config and the operative gin config
The reference model is not saved: it is re-derived from the model source at start.

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
mid-save leaves no half checkpoint behind. A latest checkpoint that is still unreadable (a truncated
or corrupted file) is skipped with a warning, and the run resumes from the one before.

Saves are asynchronous: `save` copies the states to host memory and returns, and Orbax's thread writes them
while the next steps run (the 7B full state is ~91 GB). A later save, and the run's end (`wait`), first wait
for the one in flight. Rotation keeps the newest `max_to_keep`; Orbax deletes the oldest only once the new one
has committed, so the disk holds max_to_keep + 1 checkpoints while a save is in flight. Each save logs and
returns what the committed checkpoints take on disk (`usage`), and warns when the free space cannot hold
another checkpoint of the newest one's size.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import types

import jax
import orbax.checkpoint as ocp

from jaxrl_llm import distributed

log = logging.getLogger(__name__)


class _ReadOnlyNotices(logging.Filter):
    """Drops Orbax's warnings on opening a checkpoint dir read-only: export and resume-from-a-path do so on
    purpose, and each open printed two WARNING lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Given directory is read only",
                                                    "CheckpointManagerOptions.read_only=True"))


logging.getLogger("absl").addFilter(_ReadOnlyNotices())


class CheckpointSaveError(OSError):
    """Saving failed (disk full, unwritable run dir); the previous checkpoints are intact."""


class NoValidCheckpointError(FileNotFoundError):
    """An explicit resume path with no checkpoint that can be restored."""


def _abstract(tree):
    """ShapeDtypeStructs with shardings: the restore target, in the current layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _processes() -> ocp.options.MultiprocessingOptions:
    """Orbax's processes: every one, or (an async run over several processes) the training side's alone, whose
    barriers the rollout processes never join."""
    group = distributed.group()
    if jax.distributed.is_initialized() and len(group) < jax.process_count():
        _orbax_sees_the_side()
        return ocp.options.MultiprocessingOptions(primary_host=group[0], active_processes=set(group),
                                                  barrier_sync_key_prefix="train")
    return ocp.options.MultiprocessingOptions()


class _SideJax(types.ModuleType):
    """`jax` as Orbax's array handler sees it on an async run's training side: the process count is the side's."""

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def process_count() -> int:
        return distributed.process_count()


def _orbax_sees_the_side() -> None:
    """Orbax takes `jax.process_count()` for the processes that save: it refuses a fully addressable array when the
    count is over 1 (a pmap host-local array, which every host would write), and it expects every process's array
    metadata. On an async run's training side (processes 0..T-1 of the run: `distributed.set_group`) the rollout
    processes save nothing, and a side of one process holds exactly such arrays, written by it alone. So the
    training processes show Orbax their own count, in its two lookups of it; its barriers take
    `active_processes` (`_processes`). Process indices need no change: the training side's are 0..T-1."""
    from orbax.checkpoint._src.multihost import multihost
    from orbax.checkpoint._src.serialization import jax_array_handlers

    if not isinstance(jax_array_handlers.jax, _SideJax):
        jax_array_handlers.jax = _SideJax("jax")
        multihost.process_count = distributed.process_count


class RunCheckpointer:
    """Saves and restores a run's train states and metadata under `directory`."""

    def __init__(self, directory: str, *, max_to_keep: int | None = 2, async_save: bool = True,
                 read_only: bool = False):
        self.directory = os.path.abspath(directory)
        processes = _processes()
        create = not read_only
        if create and processes.active_processes is not None:  # Orbax creates no root for a subset of processes
            if distributed.is_main():
                os.makedirs(self.directory, exist_ok=True)
            distributed.barrier("checkpoint_dir")
            create = False
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep, enable_async_checkpointing=async_save,
            create=create, read_only=read_only, cleanup_tmp_directories=not read_only,
            multiprocessing_options=processes)
        handlers = {"actor": ocp.StandardCheckpointHandler(), "critic": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except OSError as e:
            raise CheckpointSaveError(f"checkpoint dir {self.directory}: cannot create or open it ({e}); "
                                      "check the path and permissions of train.run_dir") from None

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def usage(self) -> dict[str, float]:
        """What the committed checkpoints take on disk (perf/ metrics: the machine's, not the computation's):
        the newest one's GB, all kept ones' GB and count, and the GB free on the checkpoint dir's disk."""
        sizes = {s: _dir_bytes(os.path.join(self.directory, str(s))) for s in self.steps()
                 if os.path.isdir(os.path.join(self.directory, str(s)))}  # a step in flight has a temporary name
        return {"perf/checkpoint_last_gb": sizes[max(sizes)] / 1e9 if sizes else 0.0,
                "perf/checkpoint_kept_gb": sum(sizes.values()) / 1e9, "perf/checkpoint_kept": float(len(sizes)),
                "perf/disk_free_gb": shutil.disk_usage(self.directory).free / 1e9}

    def save(self, step: int, *, actor, meta: dict, critic=None) -> dict[str, float]:
        """Starts an async save once the previous one has committed (Orbax waits for it too); `wait()` blocks until
        this one is committed. Returns `usage()` of the checkpoints committed before it."""
        self.wait()
        usage = self.usage()
        last, free = usage["perf/checkpoint_last_gb"], usage["perf/disk_free_gb"]
        if distributed.is_main():
            log.info("checkpoints in %s: %d kept, %.2f GB (the newest %.2f GB); %.1f GB free; saving step %d",
                     self.directory, usage["perf/checkpoint_kept"], usage["perf/checkpoint_kept_gb"], last, free, step)
            if last > free:
                log.warning("checkpoint step %d may not fit: %.1f GB free in %s, and the newest checkpoint took %.2f "
                            "GB (the oldest is deleted only after the new one commits). Free disk space, lower "
                            "train.max_checkpoints_to_keep or move train.run_dir", step, free, self.directory, last)
        items = {"actor": ocp.args.StandardSave(actor), "meta": ocp.args.JsonSave(meta)}
        if critic is not None:
            items["critic"] = ocp.args.StandardSave(critic)
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except OSError as e:
            raise CheckpointSaveError(
                f"saving checkpoint step {step} in {self.directory} failed ({e}); the earlier checkpoints "
                f"{self.steps()} are intact. Free disk space or fix the permissions of train.run_dir, then "
                "rerun: the run resumes from the last good checkpoint") from None
        return usage

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except OSError as e:
            raise CheckpointSaveError(
                f"finishing a checkpoint save in {self.directory} failed ({e}); the earlier checkpoints "
                "are intact. Free disk space or fix the permissions of train.run_dir, then rerun") from None

    def restore(self, step: int, *, actor, critic=None) -> tuple:
        """Restores `step` into the layout of the given (live or abstract) trees; returns
        (actor, critic or None, meta)."""
        items = {"actor": ocp.args.StandardRestore(_abstract(actor)), "meta": ocp.args.JsonRestore()}
        if critic is not None:
            items["critic"] = ocp.args.StandardRestore(_abstract(critic))
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        return out["actor"], (out["critic"] if critic is not None else None), dict(out["meta"])

    def restore_latest_valid(self, *, actor, critic=None) -> tuple | None:
        """The newest checkpoint that restores cleanly, falling back past broken ones; None if none."""
        steps = self.steps()
        for i, step in enumerate(reversed(steps)):
            error = None
            try:
                restored = self.restore(step, actor=actor, critic=critic)
            except Exception as e:  # a truncated or corrupted file surfaces as many error types
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            # Each process reads only its own shards: all of them must have read theirs.
            errors = [x for x in distributed.allgather_objects(error) if x is not None]
            if errors:
                older = steps[-i - 2] if len(steps) > i + 1 else None
                log.warning("checkpoint step %d in %s is unreadable (%s); %s", step, self.directory, errors[0],
                            f"resuming from step {older} instead" if older is not None else "no older one")
                continue
            if i:
                log.warning("resumed from step %d, the newest checkpoint that restores", step)
            return (step, *restored)
        return None

    def set_aside_after(self, step: int) -> list[str]:
        """Moves checkpoints newer than `step` out of the step sequence (renamed, not deleted): after a
        resume from `step` they belong to an abandoned timeline, and would collide with new saves.
        In a multi-process run process 0 moves them, and every process then sees the same steps."""
        newer = [s for s in self.steps() if s > step]
        if not newer:
            return []
        stamp = int(time.time())
        moved = [os.path.join(self.directory, f"set-aside-step{s}-{stamp}") for s in newer]
        if distributed.is_main():
            for s, dst in zip(newer, moved):
                os.rename(os.path.join(self.directory, str(s)), dst)
            log.warning("moved checkpoints newer than the resume step %d aside: %s", step, moved)
        distributed.barrier(f"set_aside_{step}")
        self.manager.reload()
        return moved

    def close(self) -> None:
        self.manager.close()


def _dir_bytes(path: str) -> int:
    """Bytes of every file under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def resolve_resume(resume_mode: str, run_dir: str) -> tuple[str | None, int | None]:
    """(checkpoint directory, step or None for the latest valid) to resume from, or (None, None).

    `resume_mode` is "auto" (this run's checkpoints if any), "disable", a checkpoints directory, or
    one step inside one (`RUN_DIR/checkpoints/40`).
    """
    if resume_mode == "disable":
        return None, None
    if resume_mode == "auto":
        return os.path.join(run_dir, "checkpoints"), None
    path = os.path.abspath(os.path.expanduser(resume_mode))
    if not os.path.isdir(path):
        raise NoValidCheckpointError(f"train.resume_mode={resume_mode!r}: no such checkpoint directory; use "
                                     "'auto', 'disable', RUN_DIR/checkpoints or RUN_DIR/checkpoints/<step>")
    base = os.path.basename(path.rstrip("/"))
    if base.isdigit():
        return os.path.dirname(path), int(base)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return os.path.join(path, "checkpoints"), None
    return path, None
