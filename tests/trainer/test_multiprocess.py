"""Multi-process runs on CPU (gloo collectives): one program over several JAX processes.

* 2 processes x 4 devices train exactly like 1 process x 8 devices on the same fsdp-8 mesh (GRPO from a
  HF model dir, which each process reads only its shards of, and PPO), under the plain launcher and
  under the Ray driver; the checkpoint of 2 processes exports to HF from one.
* A killed process stops the whole run with one clear error (no hang); its checkpoint (written by 2
  processes) resumes in 1, and one written by 1 process resumes in 2; the resumed steps equal the
  uninterrupted run's.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl_llm.models import Qwen2Config, init_model, save_hf
from tests.trainer import runs

STEPS = 3
MESH = ("train.mesh_fsdp=8",)
ALGOS = {
    "grpo": ("actor.use_kl_loss=True", "actor.kl_loss_coef=0.01"),  # the reference pass runs too
    "ppo": ("algorithm.adv_estimator='gae'", "critic.lr=1e-3", "rollout.n=1", "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=4"),
}
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
# One process with 8 devices, under the other XLA flags the tests run with (conftest's): the runs compared with
# it must compile alike.
XLA_FLAGS_8 = (re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
               + " --xla_force_host_platform_device_count=8").strip()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The demo's tiny model as a HF directory, so the GRPO runs import it shard by shard."""
    d = tmp_path_factory.mktemp("hf")
    save_hf(init_model(Qwen2Config.tiny(vocab_size=16), seed=3), str(d))
    return d


def _params(algo, hf_dir):
    extra = ("model.preset=None", f"model.path='{hf_dir}'") if algo == "grpo" else ()
    return (*MESH, *ALGOS[algo], *extra)


def _one_process(run_dir, *params, steps=STEPS) -> subprocess.CompletedProcess:
    return subprocess.run(runs.cli(run_dir, *params, steps=steps), cwd=runs.REPO, capture_output=True, text=True,
                          timeout=400, env={**ENV, "XLA_FLAGS": XLA_FLAGS_8})


def _launch_cmd(run_dir, *params, steps=STEPS, n=2) -> list[str]:
    args = runs.cli(run_dir, *params, steps=steps)[3:]  # the train flags, without `python -m jaxrl_llm.train`
    return [sys.executable, "-m", "jaxrl_llm.launch", "--num_processes", str(n), "--devices_per_process",
            str(8 // n), "--grace_s", "5", "--", *args]


def _launched(run_dir, *params, steps=STEPS, n=2) -> subprocess.CompletedProcess:
    return subprocess.run(_launch_cmd(run_dir, *params, steps=steps, n=n), cwd=runs.REPO, capture_output=True,
                          text=True, timeout=400, env=ENV)


def _on_ray(run_dir, *params, steps=STEPS) -> subprocess.CompletedProcess:
    cmd = runs.cli(run_dir, *params, "train.driver='ray'", "train.num_processes=2", "train.devices_per_process=4",
                   steps=steps)
    return subprocess.run(cmd, cwd=runs.REPO, capture_output=True, text=True, timeout=400, env=ENV)


def _ok(res: subprocess.CompletedProcess):
    assert res.returncode == 0, res.stderr[-4000:]


def _assert_same(got: dict, want: dict, steps):
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        assert sorted(got[s]) == sorted(want[s]), set(got[s]) ^ set(want[s])
        for k, v in want[s].items():
            np.testing.assert_allclose(got[s][k], v, rtol=1e-6, atol=1e-6, err_msg=f"step {s} {k}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, hf_dir):
    """1 process x 8 devices, every algorithm: metrics by step."""
    out = {}
    for algo in ALGOS:
        d = tmp_path_factory.mktemp(f"ref_{algo}")
        # GRPO runs a step longer: the resume tests continue past step 3.
        _ok(_one_process(d, *_params(algo, hf_dir), "train.save_freq=1", "train.max_checkpoints_to_keep=4",
                         steps=STEPS + (algo == "grpo")))
        out[algo] = runs.by_step(runs.metrics(d))
        out[f"{algo}_dir"] = d
    return out


# Each launcher with one algorithm (the launchers share everything past process start; the algorithms
# differ inside the step): GRPO on the plain launcher, PPO (critic, GAE) on Ray.
@pytest.mark.parametrize("algo, how", [("grpo", "launcher"), ("ppo", "ray")])
def test_two_processes_equal_one(tmp_path, reference, hf_dir, algo, how):
    res = (_launched if how == "launcher" else _on_ray)(tmp_path, *_params(algo, hf_dir))
    _ok(res)
    _assert_same(runs.by_step(runs.metrics(tmp_path)), reference[algo], range(1, STEPS + 1))
    if algo == "grpo" and how == "launcher":
        assert sorted(os.listdir(tmp_path / "checkpoints")) == [str(STEPS)]
        # Only process 0 logs: one metrics line per step.
        assert len(runs.metrics(tmp_path)) == STEPS
        # The checkpoint of 2 processes exports to HF from one.
        res = subprocess.run([sys.executable, "-m", "jaxrl_llm.export", "--checkpoint", str(tmp_path), "--out",
                              str(tmp_path / "hf")], cwd=runs.REPO, capture_output=True, text=True, env=ENV)
        _ok(res)
        assert (tmp_path / "hf" / "config.json").exists()


def test_one_process_checkpoint_resumes_in_two(tmp_path, reference, hf_dir):
    """The reference (1 process) saved every step: its step-2 checkpoint resumes with 2 processes."""
    shutil.copytree(reference["grpo_dir"], tmp_path, dirs_exist_ok=True)
    for step in (3, 4):  # the run's metrics.jsonl still holds steps 3 and 4: the resume cuts them
        shutil.rmtree(tmp_path / "checkpoints" / str(step))
    res = _launched(tmp_path, *_params("grpo", hf_dir), "train.save_freq=1", steps=STEPS + 1)
    _ok(res)
    assert "at step 2" in res.stderr
    _assert_same(runs.by_step(runs.metrics(tmp_path)), reference["grpo"], range(1, STEPS + 2))


def _children(pid: int) -> dict[int, int]:
    """{JAX process id: pid} of the launcher's child processes."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"JAX_PROCESS_ID" in env:
            out[int(env[b"JAX_PROCESS_ID"])] = int(entry)
    return out


def test_killed_process_stops_the_run_then_it_resumes_in_one(tmp_path, reference, hf_dir):
    """SIGKILL one of 2 processes mid-run: the launcher stops the other at once with one line; the run then
    resumes from its last checkpoint in a single process, and the resumed step equals the reference's."""
    params = (*_params("grpo", hf_dir), "train.save_freq=1")
    proc = subprocess.Popen(_launch_cmd(tmp_path, *params, steps=8), cwd=runs.REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        runs.wait_for_steps(tmp_path, 2, proc, timeout=300)
        children = _children(proc.pid)
        assert sorted(children) == [0, 1], children
        t0 = time.time()
        os.kill(children[1], signal.SIGKILL)  # mid-run: the survivor is inside the step's collectives
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "training process 1 of 2 was killed by SIGKILL" in err, err[-3000:]
    # One line: the survivor's tracebacks (Python's and gloo's) went to its log, not to the terminal.
    assert "Traceback" not in err and len([x for x in err.splitlines() if "error" in x.lower()]) == 1, err[-3000:]
    assert "Rerun the same command to resume from the last checkpoint (step" in err
    assert (tmp_path / "logs" / "process_0.log").stat().st_size > 0
    assert time.time() - t0 < 60
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in children.values())
    saved = max(int(p) for p in os.listdir(tmp_path / "checkpoints") if p.isdigit())
    assert 1 <= saved <= STEPS, saved  # step 2 may still have been committing (async saves)
    # Written by 2 processes, resumed by 1: the steps after the checkpoint equal the reference run's (the resume
    # cuts the killed run's later steps from metrics.jsonl).
    res = _one_process(tmp_path, *params, steps=STEPS + 1)
    _ok(res)
    assert f"at step {saved}" in res.stderr
    _assert_same(runs.by_step(runs.metrics(tmp_path)), reference["grpo"], range(1, STEPS + 2))


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_ray_driver_reports_a_dead_process(tmp_path, hf_dir):
    # PPO as in test_two_processes_equal_one[ppo-ray]. The kill lands once both processes have joined and process 0
    # has begun building its trainer (it writes operative_config.gin then), rather than after the first step: the
    # driver notices a dead actor the same way at any point of `fit`, and the first step cost ~30 s here, most of it
    # process 1 compiling cold (jax writes its persistent cache from process 0 alone, and on CPU the cache key of
    # each process differs).
    cmd = runs.cli(tmp_path, *_params("ppo", hf_dir), "train.driver='ray'", "train.num_processes=2",
                   "train.devices_per_process=4", "train.save_freq=1", steps=8)
    proc = subprocess.Popen(cmd, cwd=runs.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    try:
        _wait_for_file(tmp_path / "operative_config.gin", proc, timeout=300)
        victims = [int(e) for e in os.listdir("/proc") if e.isdigit() and _cmdline(int(e)).startswith(
            "ray::TrainProcess")]
        assert len(victims) == 2, victims
        os.kill(max(victims), signal.SIGKILL)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2
    assert "error: DistributedError: trainer process" in err and "died" in err, err[-3000:]


def _wait_for_file(path, proc: subprocess.Popen, timeout: float) -> None:
    t_end = time.time() + timeout
    while time.time() < t_end:
        if path.exists():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"run exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{path} not written after {timeout}s")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
