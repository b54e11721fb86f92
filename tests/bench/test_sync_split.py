"""The `sync_split` benchmark section on simulated CPU devices: its rows come out for a split whose plain device_put
goes through the host (so the row says so) while the weight sync stays device to device; a bad split is one
clear error."""

import json

import pytest

from jaxrl_llm.bench import __main__ as cli
from jaxrl_llm.bench.sync_split import parse_split


def test_the_section_runs_on_cpu_and_flags_the_naive_host_copy(tmp_path, own_rows):
    # Training fsdp 1 x tensor 2, rollout fsdp 2: the heads' shards on one side are not the other's.
    cli.main(["--sections", "sync_split", "--small", "--sync_splits", "2tp2+2,7+2", "--repeats", "1",
              "--lora_rank", "2", "--out", str(tmp_path)])
    rows = {r.get("what"): r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    assert "error" not in json.dumps(list(rows.values())).replace('"what": "skipped", "error"', ""), rows
    assert rows["skipped"]["error"] == "needs 9 devices, this machine has 8"
    assert rows["device_put"]["host_copy"] is True
    for what in ("sync/bf16", "sync/fp32", "engine_convert", "lora/bf16", "lora/int8"):
        assert rows[what]["seconds"] > 0, what
    assert rows["sync/fp32"]["buckets"] > 0 and rows["sync/bf16"]["gb"] > 0
    assert 0 < rows["lora/int8"]["gb"] < rows["lora/int8"]["base_gb"]
    assert "keep tensor2" in rows["sync/bf16"]["route"][0]


def test_a_bad_split_is_one_clear_error():
    assert parse_split("2tp2+1") == ((2, 2), (1, 1))
    for bad in ("2+", "3tp2+1", "0+1", "2x2"):
        with pytest.raises(ValueError, match=r"--sync_splits: .*use A\+B or AtpX\+BtpY"):
            parse_split(bad)
