"""The launcher's output: each process's output in its own log under the run dir, process 0's on the
terminal; when one fails, one line naming it and its cause, and no tracebacks of the others; a bad config is
one config error, reported before any process starts."""

import os
import subprocess
import sys

from tests.trainer import runs


def _launch(*args, n: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxrl_llm.launch", "--num_processes", str(n), "--grace_s", "2",
                           *map(str, args)], cwd=runs.REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_a_crashed_process_is_one_line_naming_it_and_its_exception(tmp_path):
    res = _launch("--module", "tests.launch_child", "--log_dir", tmp_path, "--", "crash", 1)
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()
    assert err == [f"error: training process 1 of 2 exited with code 1: RuntimeError: boom in the step; stopped the "
                   f"other 1 process(es) (every process's output: {tmp_path}/). Rerun the same command to resume from "
                   "the last checkpoint"], res.stderr
    assert res.stdout == "process 0 started\n"  # process 0's output reaches the terminal, process 1's does not
    crashed = (tmp_path / "process_1.log").read_text()
    assert "process 1 started" in crashed and "Traceback" in crashed and "RuntimeError: boom" in crashed
    assert "XlaRuntimeError: gloo" in (tmp_path / "process_0.log").read_text()  # the survivor's trace: in its log


def test_a_process_stopped_by_bad_input_is_reported_as_such(tmp_path):
    res = _launch("--module", "tests.launch_child", "--log_dir", tmp_path, "--", "usage", 0)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"error: training process 0 of 2: config: data.train_files: no training files given (every process's "
        f"output: {tmp_path}/)"], res.stderr  # not "rerun to resume": the rerun would fail the same way
    assert "XlaRuntimeError: gloo" in (tmp_path / "process_1.log").read_text()  # the survivor's trace: in its log


def test_a_bad_config_is_one_config_error_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    res = _launch("--devices_per_process", 4, "--", "--gin_file=gin/grpo_tiny.gin", "--gin.actor.lrr=1e-3",
                  f"--gin.train.run_dir='{run_dir}'")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: config: unknown key actor.lrr (bindings string line 1); did you mean actor.lr or actor.min_lr_ratio "
        "or actor.lr_scheduler? (`python -m jaxrl_llm.train --list_keys` lists every key with its default and doc)"]
    assert not run_dir.exists()


def test_a_training_process_that_fails_on_its_data_names_the_process_and_the_error(tmp_path, qwen2_tokenizer_dir):
    """Both processes of a real run stop on a missing dataset file: one line, a process's DataError (whichever
    exits first: both fail on the same input), each process's output in <run_dir>/logs."""
    run_dir = tmp_path / "run"
    res = _launch("--devices_per_process", 4, "--", "--gin_file=gin/grpo_tiny.gin", "--gin.train.mesh_fsdp=8",
                  "--gin.data.source='files'", f"--gin.data.train_files='{tmp_path}/none.parquet'",
                  f"--gin.model.tokenizer_path='{qwen2_tokenizer_dir}'", f"--gin.train.run_dir='{run_dir}'")
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors in ([f"error: training process {i} of 2: DataError: {tmp_path}/none.parquet: no such dataset file "
                       f"(every process's output: {run_dir}/logs/)"] for i in (0, 1)), res.stderr
    for i in (0, 1):
        assert "DataError" in (run_dir / "logs" / f"process_{i}.log").read_text()
