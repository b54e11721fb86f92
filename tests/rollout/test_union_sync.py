"""The weight sync across processes (rollout/union_copy.py, `WeightSync(side=...)`): two real processes joined by
`jax.distributed` on CPU (gloo), a training mesh on one and a rollout mesh on the other. fp32 masters arrive bit for
bit (cast in layer buckets), through one program over both processes' devices, with no host round trip (the
transfer guard) and no file opened on either side (tests/rollout/union_sync_child.py)."""

import os
import subprocess
import sys

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
