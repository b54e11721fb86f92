"""The run report: reading metrics.jsonl (killed, resumed, non-finite), the PNGs, summary.md and the CLI.

All on a synthetic 60-step GRPO-like run: validation before training (step 0) and every 10 steps on lines
of their own, two data sources, a "nan" reward at step 30, no KL, MFU or value-loss metrics, and a last
line cut short by a killed run.
"""

import json
import logging
import math
import struct
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_llm.report import ReportError, load_metrics, write_report
from jaxrl_llm.report.plots import compute_ema

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 60


def _reward(s):
    return {30: "nan", 55: 0.99}.get(s, round(0.01 * s, 4))


def _val(s):
    gsm8k, math_ = s / 100, 0.5 if s == 30 else 0.2
    return {"val-core/gsm8k/reward/mean@1": gsm8k, "val-core/math/reward/mean@1": math_,
            "val-core/mean": (gsm8k + math_) / 2}


def _train(s):
    return {"critic/score/mean": _reward(s), "actor/entropy": 2.0 - s / STEPS, "actor/pg_clipfrac": 0.01,
            "actor/pg_clipfrac_lower": 0.001, "response_length/mean": 100.0 + s, "response_length/min": 50.0,
            "response_length/max": 200.0 + s, "perf/throughput": 1000.0 + 2 * s, "actor/grad_norm": 1.0,
            "actor/lr": 1e-6, "actor/skipped_steps": 1.0 if s in (7, 8) else 0.0,
            # Step 1 compiles; later steps split 4 s as gen 25%, old_log_prob 12.5%, update_actor 50%, adv 10%.
            "timing_s/gen": 1.0, "timing_s/old_log_prob": 0.5, "timing_s/update_actor": 2.0, "timing_s/adv": 0.4,
            "timing_s/step": 34.0 if s == 1 else 4.0, "perf/pack_fill": 0.875,
            # The first step compiles; step 9 met a program shape that was not built ahead.
            "perf/compiles": {1: 12, 9: 1}.get(s, 0), "perf/compile_s": {1: 30.0, 9: 2.5}.get(s, 0.0)}


def _ppo(s):
    """What a PPO run with a KL loss adds: the metrics whose panels the GRPO-like run skips."""
    return {"actor/kl_loss": 0.001 * s, "actor/reward_kl_penalty": 0.002 * s, "perf/mfu/actor": 0.25,
            "critic/vf_loss": 1.0 / s}


def _write_run(run_dir, ppo=False):
    lines = [{"step": 0, **_val(0)}]
    for s in range(1, STEPS + 1):
        lines.append({"step": s, **_train(s), **(_ppo(s) if ppo else {})})
        if s % 10 == 0:
            lines.append({"step": s, **_val(s), "timing_s/testing": 0.3})
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 61, "critic/score/me'
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run_dir = _write_run(tmp_path_factory.mktemp("run") / "grpo")
    (run_dir / "report").mkdir()
    (run_dir / "report" / "kl.png").write_bytes(b"from an earlier report")  # must not be left stale
    return run_dir, write_report(str(run_dir))


# ---- reading -------------------------------------------------------------------------------------
def test_load_metrics_merges_steps_and_skips_truncated_line(tmp_path, caplog):
    _write_run(tmp_path)
    with caplog.at_level(logging.WARNING):
        records = load_metrics(str(tmp_path))
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    assert set(records[0]) == {"step", *_val(0)}  # validation before training
    assert records[10]["critic/score/mean"] == 0.1 and records[10]["val-core/gsm8k/reward/mean@1"] == 0.1
    assert math.isnan(records[30]["critic/score/mean"])
    assert f"metrics.jsonl:{STEPS + STEPS // 10 + 2}: partial or invalid line skipped" in caplog.text


def test_load_metrics_resumed_run(tmp_path):
    """A killed run leaves a partial line; the resumed run appends to it and logs steps 3-4 again."""
    lines = [json.dumps({"step": s, "critic/score/mean": s}) for s in (1, 2, 3, 4)]
    lines += ['{"step": 5, "critic/sc' + json.dumps({"step": 3, "critic/score/mean": 30}),
              json.dumps({"step": 4, "critic/score/mean": 40})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    records = load_metrics(str(tmp_path))
    assert [(r["step"], r["critic/score/mean"]) for r in records] == [(1, 1), (2, 2), (3, 30), (4, 40)]


def test_load_metrics_errors(tmp_path):
    with pytest.raises(ReportError, match="nope: no such run directory"):
        load_metrics(str(tmp_path / "nope"))
    with pytest.raises(ReportError, match=r"metrics\.jsonl: no such file"):
        load_metrics(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a\nnot json\n[1, 2]\n{"no_step": 1}\n')
    with pytest.raises(ReportError, match="no valid lines"):
        load_metrics(str(tmp_path))


def test_ema_is_debiased_and_skips_nan():
    np.testing.assert_allclose(compute_ema(np.array([2.0, 2.0, np.nan, 2.0])), [2.0, 2.0, 2.0, 2.0])
    w = 0.9
    expected = (w * (1 - w) * 1.0 + (1 - w) * 3.0) / (1 - w**2)  # float64 reference of the 2nd value
    np.testing.assert_allclose(compute_ema(np.array([1.0, 3.0]), w), [1.0, expected])


# ---- the report ----------------------------------------------------------------------------------
def test_pngs_are_written_and_valid(report):
    run_dir, result = report
    assert set(result["plots"]) == {"overview", "reward", "validation", "entropy", "response_length", "clipfrac",
                                    "throughput", "timing", "grad_norm"}
    for path in result["plots"].values():
        data = open(path, "rb").read()
        assert path.startswith(str(run_dir / "report"))
        assert data[:8] == PNG_SIGNATURE, path
        width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
        assert width >= 400 and height >= 200 and len(data) > 5000, path


def test_summary_numbers(report):
    run_dir, result = report
    assert result["summary"] == str(run_dir / "report" / "summary.md")
    assert result["num_steps"] == STEPS
    assert result["reward"] == {"first": {"step": 1, "value": 0.01}, "last": {"step": 60, "value": 0.6},
                                "best": {"step": 55, "value": 0.99}}
    val = result["validation"]
    assert val["gsm8k"]["last"] == {"step": 60, "value": 0.6} and val["math"]["best"] == {"step": 30, "value": 0.5}
    assert val["mean"]["last"] == {"step": 60, "value": 0.4}
    t = result["step_time"]
    assert t["mean_s"] == 4.0 and t["excluded_step"] == 1
    np.testing.assert_allclose([t["phases_pct"][p] for p in ("gen", "old_log_prob", "adv", "update_actor")],
                               [25, 12.5, 10, 50])
    assert list(t["phases_pct"]) == ["gen", "old_log_prob", "adv", "update_actor"]  # the order a step runs them
    assert result["last_n"] == {"n": 20, "steps": [41, 60], "throughput": 1101.0, "mfu": None, "pack_fill": 0.875}
    assert result["compiles"] == {"first": {"step": 1, "compiles": 12, "compile_s": 30.0},
                                  "later": {"steps": [2, 60], "compiles": 1, "compile_s": 2.5, "compiled_in": [9]}}
    assert result["skipped_steps"] == {"actor/skipped_steps": 2.0}
    assert result["final_kl"] == {}

    md = open(result["summary"]).read()
    for line in ["| first | 1 | 0.01 |", "| last | 60 | 0.6 |", "| best | 55 | 0.99 |",
                 "| gsm8k | 0.6 (60) | 0.6 (60) |", "| math | 0.2 (60) | 0.5 (30) |",
                 "- Training steps: 60 (steps 1–60)",
                 "Mean timing_s/step 4 s over steps 2–60; step 1 (JIT compilation) left out.",
                 "| gen | 1 | 25.0 |", "| other (not in a phase) | | 2.5 |",
                 "## Throughput (mean over the last 20 training steps)",
                 "Steps 41–60: perf/throughput 1101 tokens/s/device, perf/mfu/actor not logged, perf/pack_fill 0.875.",
                 "| first (1) | 12 | 30 |", "| later (2–60) | 1 | 2.5 |", "Later steps that compiled: 9.",
                 "- actor/skipped_steps total: 2", "![overview](overview.png)", "- [reward](reward.png)",
                 "- critic/score/mean: 1 non-finite value(s)"]:
        assert line in md, line


def test_absent_panels_are_skipped_and_reported(report):
    run_dir, result = report
    assert set(result["skipped_panels"]) == {"kl", "vf_loss", "multi_turn"}  # not a multi-turn run
    assert not (run_dir / "report" / "kl.png").exists()
    md = open(result["summary"]).read()
    assert "## Skipped panels" in md
    assert "- kl: no actor/kl_loss or actor/reward_kl_penalty or actor/ppo_kl in metrics.jsonl" in md
    # A synchronous run: no async panel, table or skipped-panel line.
    assert result["async"] == {} and not any(name.startswith("async") for name in result["plots"])
    assert "async" not in md.lower()
    assert "No KL metric" in md
    assert any("partial or invalid line skipped" in note for note in result["notes"])


def _async_row(s):
    """An async run's step s of 12: staleness 0..2, a stale sample every third step, waits that shrink."""
    return {"critic/score/mean": s / 12, "timing_s/step": 2.0, "timing_s/update_actor": 1.0,
            "timing_s/wait_prev_gen": 0.5 if s > 1 else 1.5, "timing_s/sync": 0.05, "timing_s/rollout_wait": 0.25,
            "fully_async/staleness/mean": (s % 3) / 2, "fully_async/staleness/max": s % 3,
            "fully_async/count/stale_samples_processed": float(s % 3 == 0), "fully_async/count/stale_samples_dropped":
            float(s == 6), "fully_async/partial/partial_ratio": 0.25, "fully_async/partial/total_partial_num": 2.0,
            "rollouter/idle_ratio": 0.1, "trainer/idle_ratio": 0.2, "fully_async/version": s - 1,
            "fully_async/queue_size": 4.0}


def test_async_run_gets_its_panels_and_table(tmp_path):
    """one_step_off / fully_async metrics: three panels, a table of first/last/mean with totals of the counts; the
    trainer's wait and sync are phases of its step, the rollout side's wait is not."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **_async_row(s)}) + "\n"
                                                     for s in range(1, 13)))
    result = write_report(str(tmp_path), str(tmp_path / "out"))
    for name in ("async_staleness", "async_idle", "async_waits"):
        assert open(result["plots"][name], "rb").read()[:8] == PNG_SIGNATURE, name
    a = result["async"]
    assert a["fully_async/staleness/max"] == {"first": {"step": 1, "value": 1.0}, "last": {"step": 12, "value": 0.0},
                                              "mean": 1.0}
    totals = {"fully_async/count/stale_samples_processed": 4.0, "fully_async/count/stale_samples_dropped": 1.0,
              "fully_async/partial/total_partial_num": 24.0}
    assert a["totals"] == totals
    assert list(result["step_time"]["phases_pct"]) == ["wait_prev_gen", "update_actor", "sync"]
    assert result["step_time"]["phases_pct"]["wait_prev_gen"] == 25.0  # steps 2-12: 0.5 s of 2 s
    md = open(result["summary"]).read()
    for line in ["## Asynchronous training", "| fully_async/staleness/mean | 0.5 (1) | 0 (12) | 0.5 |",
                 "| timing_s/wait_prev_gen | 1.5 (1) | 0.5 (12) | 0.5833 |",
                 "| fully_async/version | 0 (1) | 11 (12) | 5.5 |",
                 "| trainer/idle_ratio | 0.2 (1) | 0.2 (12) | 0.2 |",
                 "Totals over the run: fully_async/count/stale_samples_processed 4, "
                 "fully_async/count/stale_samples_dropped 1, fully_async/partial/total_partial_num 24."]:
        assert line in md, line


def test_validation_only_run(tmp_path):
    """A run killed right after validation-before-training still gets a report."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, **_val(0)}) + "\n")
    result = write_report(str(tmp_path), str(tmp_path / "out"))
    assert set(result["plots"]) == {"overview", "validation"} and result["num_steps"] == 0
    assert "reward" in result["skipped_panels"] and "No critic/score/mean" in open(result["summary"]).read()


def test_multi_turn_run_reports_tool_use_and_accuracy(tmp_path):
    """An agentic run: tool calls and turns a response are plotted and tabled, next to validation accuracy."""
    rows = [{"step": s, "critic/score/mean": s / 10, "multi_turn/tool_calls_mean": min(1.0, s / 5),
             "multi_turn/turns_mean": 1 + 2 * min(1.0, s / 5)} for s in range(1, 11)]
    rows.append({"step": 10, "val-core/multiply/acc/mean@1": 0.85})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = write_report(str(tmp_path), str(tmp_path / "out"))
    assert "multi_turn" in result["plots"] and "validation" in result["plots"]
    assert result["tool_use"]["multi_turn/tool_calls_mean"]["last"] == {"step": 10, "value": 1.0}
    md = open(result["summary"]).read()
    assert "| multi_turn/tool_calls_mean | 0.2 (1) | 1 (10) | 1 (5) |" in md
    assert "| multi_turn/turns_mean | 1.4 (1) | 3 (10) | 3 (5) |" in md
    assert "| multiply | 0.85 (10) | 0.85 (10) |" in md


# ---- CLI -----------------------------------------------------------------------------------------
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxrl_llm.report", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_writes_report(tmp_path):
    """On a PPO-like run, so that the KL, MFU and value-loss panels are drawn too."""
    run_dir = _write_run(tmp_path / "run", ppo=True)
    proc = _cli(str(run_dir), "--out", str(tmp_path / "out"), "--last-n", "10")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "out" / "summary.md")
    for name in ("reward", "kl", "throughput", "vf_loss"):
        assert (tmp_path / "out" / f"{name}.png").read_bytes()[:8] == PNG_SIGNATURE, name
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "- actor/kl_loss: 0.06 (step 60)" in md and "- actor/reward_kl_penalty: 0.12 (step 60)" in md
    assert ("Steps 51–60: perf/throughput 1111 tokens/s/device, perf/mfu/actor 0.25 (25.00%), perf/pack_fill "
            "0.875.") in md
    skipped = md.split("## Skipped panels")[1].split("\n## ")[0].strip().splitlines()
    assert [line.split(":")[0] for line in skipped if line.startswith("- ")] == ["- multi_turn"]  # single-turn
    assert "warning: metrics.jsonl:" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_missing_file_is_one_error_line(tmp_path):
    proc = _cli(str(tmp_path))
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "metrics.jsonl: no such file" in proc.stderr
