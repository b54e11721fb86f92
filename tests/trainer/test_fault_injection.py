"""Runs die; nothing may be lost. SIGKILL the tiny run at 5 points and resume: every later step's
metrics equal an uninterrupted run's, bit for bit on CPU. A corrupted latest checkpoint is skipped."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from jaxrl_llm.bench import soak
from tests.trainer import runs

STEPS = 8


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run: its directory, which keeps every step's checkpoint (the corrupted, disabled and
    explicit checkpoint tests start from copies of it, or a path into it, rather than from runs of their own),
    and its metrics by step."""
    d = tmp_path_factory.mktemp("reference")
    out = runs.run(d, "train.save_freq=1", f"train.max_checkpoints_to_keep={STEPS}", steps=STEPS)
    assert out.returncode == 0, out.stderr[-3000:]
    ref = runs.by_step(runs.metrics(d))
    assert sorted(ref) == list(range(1, STEPS + 1))
    return d, ref


@pytest.fixture
def reference(reference_run):
    return reference_run[1]


def test_sigkill_at_five_points_then_resume_is_exact(tmp_path, reference, reference_run):
    reference_dir = reference_run[0]
    d = tmp_path / "run"
    kill_after = sorted(np.random.default_rng(0).choice(np.arange(1, STEPS), size=5, replace=False).tolist())
    resumed = runs.kill_then_resume(d, "train.save_freq=1", steps=STEPS, kill_after=kill_after)
    for step in range(1, STEPS + 1):
        assert resumed[step] == reference[step], f"step {step} differs after kills at {kill_after}"
    # The soak check (bench/soak.py) finds the same from the run dirs: every step equal to the uninterrupted run's,
    # and each killed run's steps after its checkpoint (where a kill came before the step's checkpoint committed)
    # equal to their second run's.
    assert soak.check(str(d), reference=str(reference_dir))["resumed_equal"]["status"] == "ok"
    report = soak.check(str(d))
    assert report["resumed_equal"]["status"] == ("ok" if report["restarts"] else "no data"), report


def test_corrupted_latest_checkpoint_resumes_from_the_previous(tmp_path, reference_run):
    """The reference run as it stood after step 4 with 3 checkpoints kept (its metrics.jsonl still holds steps
    5-8: the resume cuts them), then its latest checkpoint corrupted."""
    ref_dir, reference = reference_run
    d = tmp_path / "run"
    shutil.copytree(ref_dir, d)
    for step in (1, *range(5, STEPS + 1)):
        shutil.rmtree(d / "checkpoints" / str(step))
    latest = d / "checkpoints" / "4" / "actor"
    victims = sorted((p for p in latest.rglob("*") if p.is_file() and p.stat().st_size > 64),
                     key=lambda p: -p.stat().st_size)
    for p in victims[:3]:  # truncate the biggest data files of the latest checkpoint
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    out = runs.run(d, "train.save_freq=1", "train.max_checkpoints_to_keep=3", steps=6)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checkpoint step 4" in out.stderr and "unreadable" in out.stderr
    assert "resuming from step 3" in out.stderr
    resumed = runs.by_step(runs.metrics(d))
    for step in (4, 5, 6):  # step 4 is trained again from step 3's state, exactly as before
        assert resumed[step] == reference[step]
    assert any(p.name.startswith("set-aside-step4") for p in (d / "checkpoints").iterdir())


def test_resume_disable_starts_fresh(tmp_path, reference_run):
    """A copy of the finished reference run, run again with resume_mode='disable'."""
    ref_dir, reference = reference_run
    d = tmp_path / "run"
    shutil.copytree(ref_dir, d)
    out = runs.run(d, "train.save_freq=1", "train.resume_mode='disable'", steps=2)
    assert out.returncode == 0 and "resumed from" not in out.stderr
    assert "train.resume_mode='disable': starting from step 0" in out.stderr
    # The new run's steps only, those of a fresh start; the earlier run's rows are set aside beside it (as its
    # checkpoints are).
    got = runs.by_step(runs.metrics(d))
    assert sorted(got) == [1, 2] and got[1] == reference[1] and got[2] == reference[2]
    (aside,) = d.glob("metrics.set-aside-*.jsonl")
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == list(range(1, STEPS + 1))


def test_explicit_checkpoint_path(tmp_path, reference_run):
    """A new run directory starts from step 2 of the reference run's (not its latest checkpoint)."""
    d, reference = reference_run
    other = tmp_path / "other"
    out = runs.run(other, f"train.resume_mode='{d}/checkpoints/2'", steps=4)
    assert out.returncode == 0, out.stderr[-3000:]
    got = runs.by_step(runs.metrics(other))
    assert sorted(got) == [3, 4] and got[3] == reference[3] and got[4] == reference[4]
    bad = runs.run(tmp_path / "x", f"train.resume_mode='{tmp_path}/nowhere'", steps=1)
    assert bad.returncode == 2 and "resume_mode" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_help_runs():
    out = subprocess.run([runs.sys.executable, "-m", "jaxrl_llm.train", "--help"], cwd=runs.REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "--gin_file" in out.stdout
    assert os.path.exists(os.path.join(runs.REPO, "gin", "grpo_tiny.gin"))
