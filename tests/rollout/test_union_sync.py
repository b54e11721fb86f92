"""The weight sync across processes (rollout/union_copy.py, `WeightSync(side=...)`): two real processes joined by
`jax.distributed` on CPU (gloo), a training mesh on one and a rollout mesh on the other. fp32 masters arrive bit for
bit (cast in layer buckets), through one program over both processes' devices, with no host round trip (the
transfer guard) and no file opened on either side (tests/rollout/union_sync_child.py)."""

import json
import os
import subprocess
import sys
import types

import pytest

from jaxrl_llm.bench.sync_processes import sync_processes
from jaxrl_llm.models import PRESETS
from tests.trainer import runs


def test_weights_cross_processes_device_to_device_without_files(tmp_path):
    cmd = [sys.executable, "-m", "jaxrl_llm.launch", "--num_processes", "2", "--devices_per_process", "2", "--grace_s",
           "3", "--module", "tests.rollout.union_sync_child", "--log_dir", str(tmp_path), "--", "x"]
    res = subprocess.run(cmd, cwd=runs.REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    sent = res.stdout  # process 0's output
    got = (tmp_path / "process_1.log").read_text()
    assert sent.count("; sent") == 1 and got.count("arrived bit for bit") == 1, (sent, got[-3000:])
    # fp32 masters cast to bf16 in buckets of one layer (3 layers, then the rest) on the training process
    assert "cast in layer buckets: 78 shard copies, 600960 bytes, 4 bucket programs" in got


def test_the_cross_process_sync_benchmark_times_both_dtypes_on_the_rollout_process(tmp_path):
    """`--sections sync_processes` under the launcher: a training process sends, a rollout process receives, every
    sync under the host-copy guard; process 0 writes a row a dtype with the rollout side's seconds and bytes."""
    cmd = [sys.executable, "-m", "jaxrl_llm.launch", "--num_processes", "2", "--devices_per_process", "2", "--grace_s",
           "3", "--log_dir", str(tmp_path / "logs"), "--module", "jaxrl_llm.bench", "--", "--sections",
           "sync_processes", "--small", "--repeats", "1", "--out", str(tmp_path / "out")]
    res = subprocess.run(cmd, cwd=runs.REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    syncs = {r["what"]: r for r in rows if r["section"] == "sync_processes" and r["what"] != "setup"}
    assert sorted(syncs) == ["sync/bf16", "sync/fp32"]
    n = PRESETS["tiny"]().num_params()
    # bf16 arrives either way (the fp32 masters are cast on the training process): every parameter's 2 bytes, and
    # the few small leaves kept whole on each rollout device (the norms) once a device
    assert syncs["sync/bf16"]["gb"] == syncs["sync/fp32"]["gb"]
    for r in syncs.values():
        assert 2 * n <= round(r["gb"] * 1e9) <= 1.01 * 2 * n and r["seconds"] > 0 and r["copies"] > 0, r
    assert syncs["sync/fp32"]["buckets"] > 0 and syncs["sync/bf16"]["buckets"] == 0


def test_the_cross_process_sync_benchmark_in_one_process_is_one_clear_error():
    with pytest.raises(ValueError, match="sync_processes runs in 2 processes"):
        sync_processes(types.SimpleNamespace(small=True))
