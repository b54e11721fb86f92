"""The soak check (bench/soak.py) on run directories written here: a run killed after step 8 and resumed from its
checkpoint at step 6 (its steps 7-8 set aside, then logged again), flat or not, compiling or not."""

import json

import pytest

from jaxrl_llm.bench import soak


def write_run(d, *, memory=None, throughput=None, compiles=None, killed_loss=None):
    """Steps 1-12; the killed run's rows for steps 7-8 in a set-aside file. Each keyword overrides one step."""
    d.mkdir(exist_ok=True)

    def row(s):
        r = {"step": s, "actor/pg_loss": 0.1 * s, "critic/score/mean": 0.01 * s, "perf/throughput": 1000.0 + s % 2,
             "perf/max_memory_allocated_gb": 60.0 if s not in (1, 7) else 40.0,
             "perf/compiles": 9.0 if s in (1, 7) else 0.0, "timing_s/step": 10.0 + s}
        if s % 3 == 0:  # a checkpoint every 3 steps: the first save waits longest
            r.update({"timing_s/save_checkpoint": 8.0 if s == 3 else 2.0, "perf/checkpoint_kept": float(s > 3)})
        for key, change in (("perf/max_memory_allocated_gb", memory), ("perf/throughput", throughput),
                            ("perf/compiles", compiles)):
            if change and s in change:
                r[key] = change[s]
        return r

    (d / "metrics.jsonl").write_text("".join(json.dumps(row(s)) + "\n" for s in range(1, 13)))
    killed = [row(s) for s in (7, 8)]
    for r in killed:
        r["timing_s/step"] += 1.0  # time differs between the two runs of a step: not compared
        if killed_loss is not None and r["step"] == 7:
            r["actor/pg_loss"] = killed_loss
    (d / "metrics.set-aside-1700000000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in killed) + '{"st')
    return str(d)


def test_a_flat_run_resumed_exactly_passes(tmp_path, capsys):
    d = write_run(tmp_path / "run")
    report = soak.check(d)
    assert report["restarts"] == [6] and report["resumed_equal"]["steps"] == [7, 8]
    assert {k: report[k]["status"] for k in ("peak_memory", "throughput", "compiles", "resumed_equal")} == \
        dict.fromkeys(("peak_memory", "throughput", "compiles", "resumed_equal"), "ok")
    assert report["throughput"]["steps"] == 8  # 3-6 and 9-12: each process's first 2 steps left out
    assert [(c["step"], c["wait_s"]) for c in report["checkpoints"]] == [(3, 8.0), (6, 2.0), (9, 2.0), (12, 2.0)]
    assert report["checkpoints"][0] == {"step": 3, "wait_s": 8.0, "kept": 0.0}
    assert soak.main([d, "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["compiles"]["status"] == "ok"


@pytest.mark.parametrize("change,failed", [
    (dict(memory={11: 61.5}), "peak_memory"),  # +2.5% at step 11
    (dict(throughput={10: 940.0}), "throughput"),  # -6%
    (dict(compiles={9: 1.0}), "compiles"),  # a program compiled at the resumed process's third step
    (dict(killed_loss=0.7000001), "resumed_equal"),  # step 7 trained differently before the kill
])
def test_each_check_fails_on_its_own_fault(tmp_path, change, failed):
    report = soak.check(write_run(tmp_path / "run", **change))
    statuses = {k: report[k]["status"] for k in ("peak_memory", "throughput", "compiles", "resumed_equal")}
    assert statuses == {**dict.fromkeys(statuses, "ok"), failed: "failed"}, report
    assert soak.exit_code(report) == 1


def test_a_loose_tolerance_and_a_cpu_without_memory_figures(tmp_path):
    report = soak.check(write_run(tmp_path / "run", killed_loss=0.7000001), rtol=1e-6)
    assert report["resumed_equal"]["status"] == "ok"
    cpu = write_run(tmp_path / "cpu", memory={s: 0.0 for s in range(1, 13)})
    report = soak.check(cpu)
    assert report["peak_memory"]["status"] == "no data" and soak.exit_code(report) == 3
