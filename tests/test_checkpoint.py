"""Orbax checkpoints (checkpoint.py): a save returns before its write commits (the next steps run meanwhile), the
next save and `wait` wait for it, rotation keeps `max_to_keep`, and each save reports the committed ones' disk
usage. (A run killed at any step resumes exactly: tests/trainer/test_fault_injection.py.)"""

import os
import threading

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_llm.checkpoint import RunCheckpointer


def hold_writes(monkeypatch) -> threading.Event:
    """Orbax's array writes cannot complete before the returned event is set: a disk that takes its time."""
    gate = threading.Event()
    write = ocp.StandardCheckpointHandler.async_save

    async def held(self, directory, *args, **kwargs):
        futures = await write(self, directory, *args, **kwargs) or []
        return [*futures, _Gate(gate)]

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", held)
    return gate


class _Gate:
    def __init__(self, event: threading.Event):
        self.event = event

    def result(self, timeout=None):
        assert self.event.wait(60), "the test never opened the gate"


def _committed(directory, step) -> bool:
    return os.path.isdir(os.path.join(directory, str(step)))  # Orbax renames the temporary dir when done


def test_a_save_returns_before_its_write_commits_and_the_next_save_waits_for_it(tmp_path, monkeypatch):
    gate = hold_writes(monkeypatch)
    d = str(tmp_path / "checkpoints")
    ck = RunCheckpointer(d, max_to_keep=2)
    state = {"w": jnp.arange(1 << 20, dtype=jnp.float32).reshape(256, -1)}  # [256, 4096]: 4 MiB
    usage = ck.save(1, actor=state, meta={"step": 1})
    assert not _committed(d, 1)  # returned while the write is held back: the caller's next step runs now
    assert usage["perf/checkpoint_kept"] == 0 and usage["perf/disk_free_gb"] > 0
    opened = threading.Timer(0.5, gate.set)
    opened.start()
    usage = ck.save(2, actor=jax_add(state, 1.0), meta={"step": 2})  # waits for step 1 to commit first
    assert _committed(d, 1) and usage["perf/checkpoint_kept"] == 1
    assert 0 < usage["perf/checkpoint_last_gb"] == usage["perf/checkpoint_kept_gb"]
    ck.save(3, actor=jax_add(state, 2.0), meta={"step": 3})
    ck.wait()
    assert ck.steps() == [2, 3] and not _committed(d, 1)  # rotation: the newest max_to_keep
    assert ck.usage()["perf/checkpoint_kept"] == 2
    _, actor, _, meta = ck.restore_latest_valid(actor=state)
    np.testing.assert_array_equal(actor["w"], np.asarray(state["w"]) + 2.0)
    assert meta == {"step": 3}
    ck.close()


def jax_add(tree, x):
    return {k: v + x for k, v in tree.items()}
