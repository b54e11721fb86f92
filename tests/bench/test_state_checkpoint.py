"""The `checkpoint` benchmark section on simulated CPU devices: the trainer's full state saved (the step's wait, then
the write), committed and restored equal, with its size on disk."""

import json

from jaxrl_llm.bench import __main__ as cli


def test_the_checkpoint_section_saves_and_restores_the_full_state(tmp_path, own_rows):
    work = tmp_path / "not" / "made"  # a --work_dir that does not exist yet is made (it failed on a GPU so)
    cli.main(["--sections", "checkpoint", "--small", "--repeats", "1", "--work_dir", str(work),
              "--out", str(tmp_path / "out")])
    (row,) = json.loads((tmp_path / "out" / "bench.json").read_text())["results"]
    assert row["restored_equal"] and row["state_gb"] > 0 and 0 < row["disk_gb"] <= row["state_gb"]
    assert row["save_call_s"] > 0 and row["commit_s"] >= 0 and row["restore_s"] > 0
    assert list(work.iterdir()) == []  # its checkpoints are gone
