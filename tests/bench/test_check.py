"""The GPU check's logic on a CPU: figures found in a config's rows, compared with the recorded ones, reports
merged and recorded; a config runs in its own process, and one that would overrun the budget is reported,
not started. (Its timings on a GPU are the check's own business, never a test's.)"""

import json
import os
import subprocess

from jaxrl_llm.bench import check, harness
from jaxrl_llm.bench.check import Config, Figure

BASE = {"tolerance": 0.1, "figures": {"step_s": {"unit": "s", "better": "lower",
                                                 "recorded": {"GPU": {"value": 10.0, "source": "run.json"}}}}}
STEP = Figure("step_s", {"section": "e2e", "step": 1}, "wall_s")


def test_a_figure_is_ok_within_the_tolerance_and_not_past_it_or_on_an_error():
    rows = [{"section": "e2e", "step": 0, "wall_s": 99.0}, {"section": "e2e", "step": 1, "wall_s": 10.9}]
    value, error = check.find(rows, STEP)
    assert (value, error) == (10.9, None)
    row = check.compare(STEP, value, None, "GPU", BASE, "e2e")
    assert row["ok"] and row["ratio"] == 1.09 and row["recorded"] == 10.0 and row["figure"] == 10.9
    assert not check.compare(STEP, 11.2, None, "GPU", BASE, "e2e")["ok"]  # 12% slower
    assert check.compare(STEP, 11.2, None, "Other GPU", BASE, "e2e")["ok"]  # nothing recorded there
    oom = [{"section": "e2e", "error": "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory"}]
    value, error = check.find(oom, STEP)
    row = check.compare(STEP, value, error, "GPU", BASE, "e2e")
    assert not row["ok"] and "RESOURCE_EXHAUSTED" in row["error"]


def test_the_baselines_cover_the_configs_and_name_runs_that_exist():
    baselines = check.load_baselines()
    figures = {f.name for c in check.CONFIGS for f in c.figures}
    assert figures == set(baselines["figures"])
    assert set(check.DEFAULT) <= {c.name for c in check.CONFIGS}
    for name, spec in baselines["figures"].items():
        for device, rec in spec["recorded"].items():
            run = rec["source"].split(" ")[0]
            assert os.path.exists(os.path.join(check.REPO, run)), (name, device, run)
            assert rec["value"] > 0


def test_reports_merge_and_new_figures_are_recorded(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    meta = {"date": "2026-11-27", "device": "GPU", "commit": "abc"}
    a.write_text(json.dumps({"meta": meta, "results": [{"config": "x", "ok": False, "error": "not run"},
                                                       {"config": "y", "ok": True}]}))
    b.write_text(json.dumps({"meta": meta, "results": [{"config": "x", "ok": True, "figure": 3.0}]}))
    merged = check.merge([str(a), str(b)])
    assert merged["results"] == [{"config": "x", "ok": True, "figure": 3.0}, {"config": "y", "ok": True}]
    path = tmp_path / "baselines.json"
    base = json.loads(json.dumps(BASE))
    added = check.record([{"config": "step_s", "ok": True, "figure": 9.5}], "New GPU", base, str(tmp_path / "r.json"),
                         path=str(path), meta=meta)
    written = json.loads(path.read_text())["figures"]["step_s"]["recorded"]
    assert added == ["step_s"] and written["New GPU"]["value"] == 9.5
    assert (written["New GPU"]["commit"], written["New GPU"]["date"]) == ("abc", "2026-11-27")
    # the file keeps one line per recorded figure, so a diff shows what a --record added
    assert sum('"New GPU": {"value": 9.5' in line for line in path.read_text().splitlines()) == 1
    assert check.record([{"config": "step_s", "ok": True, "figure": 1.0}], "GPU", base, "r", path=str(path)) == []


def test_a_config_runs_in_its_own_process_and_one_past_the_budget_is_not_started(tmp_path, monkeypatch):
    fwd = Figure("fwd_ms", {"section": "logprob", "impl": "chunked"}, "fwd_ms")
    configs = (Config("logprob", ("--sections", "logprob", "--small"), (fwd,), 60),
               Config("slow", ("--sections", "logprob", "--small"), (Figure("slow_ms", {"section": "logprob"}, "x"),),
                      10**6))
    monkeypatch.setattr(check, "CONFIGS", configs)
    base = {"tolerance": 0.1, "figures": {"fwd_ms": {"recorded": {}}, "slow_ms": {"recorded": {}}}}
    device, rows = check.check(["logprob", "slow"], out_dir=str(tmp_path), budget_s=300, compile_cache="",
                               baselines=base)
    assert device == "cpu"
    assert rows[0]["config"] == "fwd_ms" and rows[0]["ok"] and rows[0]["figure"] > 0
    assert not rows[1]["ok"] and rows[1]["error"].startswith("not run:") and "--configs slow" in rows[1]["error"]
    assert (tmp_path / "logprob.log").exists()


def test_reports_of_two_device_kinds_at_one_commit_have_two_names():
    h100 = check.report_path("2026-11-26", "abc1234", "NVIDIA H100 80GB HBM3")
    h200 = check.report_path("2026-11-26", "abc1234", "NVIDIA H200")
    assert h100.endswith("gpu_check_abc1234_h100.json") and h200.endswith("gpu_check_abc1234_h200.json")
    assert check.report_path("d", "c", "cpu").endswith("gpu_check_c_cpu.json")


def test_a_merged_report_keeps_the_commit_and_date_its_calls_ran_at(tmp_path):
    meta = {"date": "2026-11-20", "device": "NVIDIA H200", "commit": "0ld5ha1"}
    parts = []
    for i, row in enumerate(({"config": "x", "ok": True}, {"config": "y", "ok": True})):
        parts.append(tmp_path / f"{i}.json")
        parts[-1].write_text(json.dumps({"meta": meta, "results": [row]}))
    merged = check.merge([str(p) for p in parts])
    out = check.write_report(merged["results"], merged["meta"]["device"], str(tmp_path / "m.json"),
                             meta=merged["meta"])
    assert json.loads(open(out).read())["meta"] == meta


def _git(repo, *args) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def test_the_files_that_ran_name_their_commit_whatever_the_copys_git_says(tmp_path):
    """A lent machine's copy of the tree can sit on an older commit (its report read '19fb848+dirty' for the tree of
    a later one): the report carries the files' git tree, and a merge here names the commit of that tree."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert harness.tree(str(repo)) == _git(repo, "rev-parse", "HEAD^{tree}")
    (repo / "b.py").write_text("y = 2\n")  # untracked: part of what runs, so part of the tree
    (repo / "a.py").write_text("x = 3\n")
    ran = harness.tree(str(repo))
    assert ran != _git(repo, "rev-parse", "HEAD^{tree}") and harness.commit_of_tree(ran, str(repo)) is None
    assert _git(repo, "diff", "--cached", "--name-only") == ""  # git's own index untouched: nothing staged
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    assert harness.commit_of_tree(ran, str(repo)) == _git(repo, "rev-parse", "--short", "HEAD")

    head_tree = _git(check.REPO, "rev-parse", "HEAD^{tree}")
    named = check.named_commit({"date": "d", "device": "NVIDIA H200", "commit": "0ld5ha1+dirty", "tree": head_tree})
    assert named["ran_as"] == "0ld5ha1+dirty"
    assert _git(check.REPO, "rev-parse", f"{named['commit']}^{{tree}}") == head_tree
    stale = {"commit": "0ld5ha1+dirty", "tree": "0" * 40}
    assert check.named_commit(stale) == stale
    assert check.report_path("d", "0ld5ha1+dirty", "NVIDIA H200").endswith("gpu_check_0ld5ha1-dirty_h200.json")
