"""Helpers to run the tiny GRPO demo as a real CLI process, and to read its metrics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A short, fast version of gin/grpo_tiny.gin: 8 prompts x 4 responses a step, with micro-batches sized for them. A
# mini-batch (4 prompts x 4) is ~176 tokens, two packed rows of 128; the demo's budget (4096 tokens a device, for its
# 400 rows) ran every update on 4096 tokens a device and every log-prob pass on twice that: 32,768 and 65,536 tokens
# on an 8-device mesh, where a step took 7.7 s (0.9 s at 256; the two-process runs' steps alike).
FAST = ["train.progress_bar=False", "train.logger=('jsonl',)", "train.val_before_train=False", "train.test_freq=-1",
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
        "actor.ppo_max_token_len_per_gpu=256"]

# Metrics that measure time rather than the computation; they differ between runs.
TIME_KEYS = ("timing_s/", "timing_per_token_ms/", "perf/")


def optimised_env(*, devices: int = 1, **extra: str) -> dict[str, str]:
    """This process's environment with XLA's CPU backend at its default optimisation level and `devices` simulated
    CPU devices, plus `extra`, for the long learning runs. conftest compiles unoptimised, which pays where a program
    runs a few times (most tests); a demo runs its step programs hundreds of times, and ran ~1.7x slower unoptimised
    (tests/trainer/test_demo.py: 199 s against 117 s). The synchronous demos' meshes take one device, as
    a user's CPU run does; the 8 devices conftest simulates only slowed their steps (Qwen3.5 demo 0.38 -> 0.27 s a
    step, GRPO 0.27 -> 0.22 s, agent demo 0.70 -> 0.62 s, with the same metrics bit for bit). A run compared exactly
    with one of these must use it too."""
    flags = re.sub(r"--xla_backend_optimization_level=\d+|--xla_force_host_platform_device_count=\d+|"
                   r"--xla_cpu_use_fusion_emitters=\w+", "", os.environ.get("XLA_FLAGS", ""))
    flags += f" --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "XLA_FLAGS": " ".join(flags.split()), **extra}


def cli(run_dir, *params, steps: int, extra_env=None) -> list[str]:
    args = [sys.executable, "-m", "jaxrl_llm.train", "--gin_file=gin/grpo_tiny.gin"]
    for p in (*FAST, f"train.total_training_steps={steps}", f"train.run_dir='{run_dir}'", *params):
        args.append(f"--gin_param={p}")
    return args


def run(run_dir, *params, steps: int, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cli(run_dir, *params, steps=steps), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def start(run_dir, *params, steps: int) -> subprocess.Popen:
    return subprocess.Popen(cli(run_dir, *params, steps=steps), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def metrics(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
                out.append(json.loads(line))
    return out


def by_step(rows: list[dict]) -> dict[int, dict]:
    """The last logged metrics of each step, without the wall-clock ones."""
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows}


def wait_for_steps(run_dir, n: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    t_end = time.time() + timeout
    while time.time() < t_end:
        if len(metrics(run_dir)) >= n:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"run exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{run_dir}: fewer than {n} steps after {timeout}s")


def wait_for_checkpoint(run_dir, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Waits until checkpoint `step` has committed (orbax renames its temporary directory to the step's number
    once every file is written), failing early if the run exits."""
    path = os.path.join(run_dir, "checkpoints", str(step))
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.isdir(path):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"run exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{run_dir}: checkpoint {step} not committed after {timeout}s")


def kill_then_resume(run_dir, *params: str, steps: int, kill_after, checkpoint: int | None = None) -> dict[int, dict]:
    """Starts the run `len(kill_after)` times, SIGKILLs it once each time `kill_after[i]` steps are logged
    (and, given `checkpoint`, that checkpoint has committed), then runs it to the end (it resumes from its
    checkpoints); returns its metrics by step, after checking the last run said it resumed and every step
    is there."""
    import signal

    for k in kill_after:
        proc = start(run_dir, *params, steps=steps)
        wait_for_steps(run_dir, k, proc)
        if checkpoint is not None:
            wait_for_checkpoint(run_dir, checkpoint, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    out = run(run_dir, *params, steps=steps)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr
    resumed = by_step(metrics(run_dir))
    assert sorted(resumed) == list(range(1, steps + 1))
    return resumed


def run_config(*params: str, steps: int = 2, run_dir=None):
    """A RunConfig of the tiny demo with FAST settings plus `params`, parsed like the CLI does."""
    import gin

    from jaxrl_llm.train import parse_config

    gin.clear_config()
    extra = [f"train.total_training_steps={steps}"] + ([f"train.run_dir='{run_dir}'"] if run_dir else [])
    return parse_config(["gin/grpo_tiny.gin"], [*FAST, *extra, *params])
