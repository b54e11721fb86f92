"""Asynchronous training over several processes (trainer/processes/placement.py): a training process and a rollout
process
joined by `jax.distributed` on CPU (gloo), each with a device of its own. They train exactly as the one-process
async trainer does on two devices (one step off under the plain launcher, fully async under the Ray driver), the
weights crossing by one program over both processes' devices (never a file); a split that cannot work is refused
before any process starts, naming its keys."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_llm.errors import ConfigValueError
from jaxrl_llm.trainer.processes.placement import check_processes
from tests.trainer import runs

SPLIT = ("rollout.n_gpus_per_node=1", "train.n_gpus_per_node=1")
MODES = {  # one step off also validates before the first step (the rollout process has no weights until a sync)
    "one_step_off": ("async_training.mode='one_step_off'", "train.val_before_train=True", *SPLIT),
    "fully_async": ("async_training.mode='fully_async'", "actor.ppo_mini_batch_size=8", *SPLIT),
}
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
STEPS = 3


def _two_processes(run_dir, how: str, *params) -> subprocess.CompletedProcess:
    if how == "launcher":
        cmd = [sys.executable, "-m", "jaxrl_llm.launch", "--num_processes", "2", "--devices_per_process", "1",
               "--grace_s", "5", "--", *runs.cli(run_dir, *params, steps=STEPS)[3:]]
    else:
        cmd = runs.cli(run_dir, *params, "train.driver='ray'", "train.num_processes=2", "train.devices_per_process=1",
                       steps=STEPS)
    return subprocess.run(cmd, cwd=runs.REPO, capture_output=True, text=True, timeout=400, env=ENV)


@pytest.mark.parametrize("mode, how", [("one_step_off", "launcher"), ("fully_async", "ray")])
def test_two_processes_train_exactly_as_one(tmp_path, mode, how):
    """Same seed, same split (one training device, one rollout device): every metric but time equals the one-process
    run's, step by step, including the staleness and version counters and the bytes each sync moved; only the
    sync's path differs (`rollouter/weight_sync_cross_process`)."""
    one = runs.run(tmp_path / "one", *MODES[mode], steps=STEPS, timeout=400)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _two_processes(tmp_path / "two", how, *MODES[mode])
    assert two.returncode == 0, two.stderr[-3000:]
    want, got = (runs.by_step(runs.metrics(tmp_path / d)) for d in ("one", "two"))
    validated = [0] if mode == "one_step_off" else []  # step 0: the validation before training, alone
    assert sorted(got) == sorted(want) == validated + list(range(1, STEPS + 1))
    assert not validated or "val-core/mean" in got[0]  # (every key compared below)
    skip = ("trainer/idle", "rollouter/idle", "rollouter/active", "rollouter/weight_sync_cross_process")
    for step in want:
        if step == 0:
            continue  # compared below with the rest of its keys
        assert got[step]["rollouter/weight_sync_cross_process"] == 1 and want[step][
            "rollouter/weight_sync_cross_process"] == 0
        assert got[step]["rollouter/weight_sync_mb"] > 0
        keys = {k for k in want[step] if not k.startswith(skip)}
        assert keys == {k for k in got[step] if not k.startswith(skip)}
        for k in sorted(keys):  # the sampler-trainer log-prob gap is float noise (~1e-7) that XLA's threads vary
            atol = 1e-6 if k.startswith("actor/logprob_gap") else 1e-7
            np.testing.assert_allclose(got[step][k], want[step][k], rtol=1e-6, atol=atol, err_msg=f"step {step} {k}")
    assert [got[s]["fully_async/version"] for s in got if s] == [want[s]["fully_async/version"] for s in want if s]
    assert not (tmp_path / "two" / "weights").exists()  # no weights checkpoint for a pool: nothing through files
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == [str(STEPS)]  # saved by the training side alone


def test_a_split_the_processes_cannot_hold_is_one_error_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "jaxrl_llm.launch", "--num_processes", "3", "--devices_per_process",
                          "1", "--", *runs.cli(run_dir, *MODES["one_step_off"], steps=1)[3:]], cwd=runs.REPO,
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: config: async_training.mode = 'one_step_off' over 3 processes: a process is one node of one side, so "
        "train.nnodes (1) + rollout.nnodes (1) must be 3; set them (the first train.nnodes processes train, the "
        "others generate)"], res.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("params, devices, key", [
    (("train.nnodes=1", "rollout.nnodes=2"), None, "rollout.nnodes = 2"),
    (("rollout.n_gpus_per_node=2", "train.n_gpus_per_node=1", "train.nnodes=2"), None,
     r"train.n_gpus_per_node \(1\) and rollout.n_gpus_per_node \(2\) differ"),
    ((), 4, "each process has 4 devices but train.n_gpus_per_node and rollout.n_gpus_per_node say 1"),
])
def test_splits_over_processes_that_cannot_work_are_refused_naming_their_keys(params, devices, key):
    run = runs.run_config(*MODES["one_step_off"], *params)
    with pytest.raises(ConfigValueError, match=key):
        check_processes(run, 3 if "train.nnodes=2" in params or "rollout.nnodes=2" in params else 2, devices)
    check_processes(runs.run_config(*MODES["one_step_off"]), 2, 1)  # the split the tests run
