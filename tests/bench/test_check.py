"""The GPU check's logic on a CPU: figures found in a config's rows, compared with the recorded ones, reports
merged and recorded; a config runs in its own process, and one that would overrun the budget is reported,
not started. (Its timings on a GPU are the check's own business, never a test's.)"""

import importlib.util
import json
import os
import subprocess

import pytest

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
    unknown = check.compare(STEP, 11.2, None, "Other GPU", BASE, "e2e")  # nothing recorded there: not a pass
    assert not unknown["ok"] and unknown["status"] == "no baseline" and unknown["figure"] == 11.2
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
    assert rows[0]["config"] == "fwd_ms" and rows[0]["status"] == "no baseline" and rows[0]["figure"] > 0
    assert not rows[1]["ok"] and rows[1]["status"] == "not run" and "--configs slow" in rows[1]["note"]
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
    a later one): the report carries the files' git tree less benchmarks/runs/, and a merge here names the commit of
    that tree, also where the copy's git index lacks runs committed since (2026-11-28: it named none)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert harness.tree(str(repo)) == _git(repo, "rev-parse", "HEAD^{tree}")  # no runs: git's own tree
    (repo / "benchmarks" / "runs").mkdir(parents=True)  # a run's own output, written while it runs: not its files
    (repo / "benchmarks" / "runs" / "gpu_check_x.json").write_text("{}\n")
    assert harness.tree(str(repo)) == _git(repo, "rev-parse", "HEAD^{tree}")
    (repo / "benchmarks" / "runs" / "gpu_check_x.json").unlink()
    (repo / "b.py").write_text("y = 2\n")  # untracked: part of what runs, so part of the tree
    (repo / "a.py").write_text("x = 3\n")
    ran = harness.tree(str(repo))
    assert ran != _git(repo, "rev-parse", "HEAD^{tree}") and harness.commit_of_tree(ran, str(repo)) is None
    assert _git(repo, "diff", "--cached", "--name-only") == ""  # git's own index untouched: nothing staged
    (repo / "benchmarks" / "runs" / "65_gen.json").write_text("{}\n")  # committed with the code, as 6d1a6ae did
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert harness.commit_of_tree(ran, str(repo)) == head  # the copy, whose index lacked 65_gen.json, ran `two`
    assert harness.tree(str(repo)) == ran == harness.commit_tree("HEAD", str(repo))

    head_tree = harness.commit_tree("HEAD")
    named = check.named_commit({"date": "d", "device": "NVIDIA H200", "commit": "0ld5ha1+dirty", "tree": head_tree})
    assert named["ran_as"] == "0ld5ha1+dirty"
    assert harness.commit_tree(named["commit"]) == head_tree
    stale = {"commit": "0ld5ha1+dirty", "tree": "0" * 40}
    assert check.named_commit(stale) == stale
    assert check.report_path("d", "0ld5ha1+dirty", "NVIDIA H200").endswith("gpu_check_0ld5ha1-dirty_h200.json")


# ---- scripts/gpu_check.py's exit code, on a clock and configs that stand in for a GPU ----------------------
H100 = "NVIDIA H100 80GB HBM3"


def gpu_check_main():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(check.REPO, "scripts", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """Each config "runs" in its expected seconds on a fake clock and measures its recorded H100 figure times
    `slower[figure]` (1.0 by default); the report goes under tmp_path. Returns `slower`."""
    clock, slower = [0.0], {}
    baselines = check.load_baselines()

    def run_config(cfg, out_dir, timeout_s, compile_cache):
        clock[0] += cfg.expected_s
        rows = [{**fig.row, fig.key: baselines["figures"][fig.name]["recorded"][H100]["value"]
                 * slower.get(fig.name, 1.0)} for fig in cfg.figures]
        return rows, H100, None

    monkeypatch.setattr(check, "run_config", run_config)
    monkeypatch.setattr(check.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(check, "report_path", lambda date, sha, device: str(tmp_path / "report.json"))
    return slower


def test_gpu_check_exits_0_when_every_default_config_runs_within_the_tolerance(fake_gpu, tmp_path, capsys):
    """The default budget starts every default config (their expected seconds add up to 1,830; a 570 s default
    left the last ones not run, and called them failures)."""
    assert gpu_check_main()(["--work_dir", str(tmp_path / "work")]) == 0
    report = check.load_report(str(tmp_path / "report.json"))
    assert {r["status"] for r in report["results"]} == {"ok"}
    assert len(report["results"]) == sum(len(c.figures) for c in check.CONFIGS if c.name in check.DEFAULT) == 8
    assert check.default_budget_s(check.DEFAULT) >= sum(c.expected_s for c in check.CONFIGS if c.name in check.DEFAULT)


def test_gpu_check_exits_1_on_a_regression(fake_gpu, tmp_path):
    fake_gpu["e2e_1p5b_step_s"] = 1.12
    assert gpu_check_main()(["--work_dir", str(tmp_path / "work")]) == 1
    rows = {r["config"]: r for r in check.load_report(str(tmp_path / "report.json"))["results"]}
    assert rows["e2e_1p5b_step_s"]["status"] == "regression" and rows["e2e_1p5b_step_s"]["ratio"] == 1.12


def test_gpu_check_exits_3_for_configs_not_run_and_says_so(fake_gpu, tmp_path):
    """A call with 570 s: the configs it does not reach are "not run", neither ok nor failed (exit 3, not 1)."""
    assert gpu_check_main()(["--work_dir", str(tmp_path / "work"), "--budget_s", "570"]) == 3
    rows = check.load_report(str(tmp_path / "report.json"))["results"]
    assert [r["status"] for r in rows] == ["ok"] * 4 + ["not run"] * 4, rows
    assert "--configs e2e_qwen3_1p7b" in rows[4]["note"] and not rows[4]["ok"]


def test_the_configs_run_in_the_order_named(fake_gpu, tmp_path):
    """A call that names a config first runs it first (it may be the one an earlier call left cached on the
    machine): with the budget for one, the other is the one not run, whichever order CONFIGS lists them in."""
    for names in (["moe_update", "e2e_1p5b"], ["e2e_1p5b", "moe_update"]):
        assert gpu_check_main()(["--work_dir", str(tmp_path / "work"), "--configs", ",".join(names),
                                 "--budget_s", "160"]) == 3
        rows = check.load_report(str(tmp_path / "report.json"))["results"]
        assert [r["run"] for r in rows] == names and [r["status"] for r in rows] == ["ok", "not run"], rows


def test_a_device_with_nothing_recorded_is_no_baseline_and_no_pass(fake_gpu, tmp_path, monkeypatch):
    base = check.load_baselines()
    for spec in base["figures"].values():
        spec["recorded"].pop(H100, None)
    monkeypatch.setattr(check, "load_baselines", lambda: base)
    assert gpu_check_main()(["--work_dir", str(tmp_path / "work"), "--configs", "e2e_1p5b"]) == 3
    (row,) = check.load_report(str(tmp_path / "report.json"))["results"]
    assert row["status"] == "no baseline" and not row["ok"] and row["figure"] > 0
    assert check.verdict([]) == (3, {})  # nothing checked is no pass either


def test_a_figure_recorded_in_one_call_passes_a_merge_with_a_later_call(fake_gpu, tmp_path, monkeypatch):
    """A --record call marks what it recorded "recorded" in its report. Merged with a later call's report the check
    passes (the merge kept such a row "no baseline" and exited 3)."""
    base = check.load_baselines()
    base["figures"]["e2e_1p5b_step_s"]["recorded"].pop(H100)
    monkeypatch.setattr(check, "load_baselines", lambda: json.loads(json.dumps(base)))
    monkeypatch.setattr(check, "BASELINES", str(tmp_path / "baselines.json"))
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    main = gpu_check_main()
    assert main(["--work_dir", str(tmp_path / "work"), "--configs", "e2e_1p5b", "--record"]) == 0
    os.replace(tmp_path / "report.json", first)
    (row,) = check.load_report(str(first))["results"]
    assert row["status"] == "recorded" and row["ok"]
    assert H100 in json.loads((tmp_path / "baselines.json").read_text())["figures"]["e2e_1p5b_step_s"]["recorded"]
    assert main(["--work_dir", str(tmp_path / "work"), "--configs", "moe_update"]) == 0
    os.replace(tmp_path / "report.json", second)
    assert main(["--merge", str(first), str(second)]) == 0
    statuses = {r["config"]: r["status"] for r in check.load_report(str(tmp_path / "report.json"))["results"]}
    assert statuses == {"e2e_1p5b_step_s": "recorded", "moe_update_3_layers_s": "ok"}, statuses


def test_gpu_check_copies_its_report_to_out_dir_only_when_asked(fake_gpu, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "env_out"))  # the lent machine's variable means nothing here
    (tmp_path / "env_out").mkdir()
    main = gpu_check_main()
    assert main(["--work_dir", str(tmp_path / "work"), "--configs", "moe_update"]) == 0
    assert os.listdir(tmp_path / "env_out") == []
    assert main(["--work_dir", str(tmp_path / "work"), "--configs", "moe_update", "--out_dir",
                 str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.json").exists() and (tmp_path / "out" / "gpu_check_runs").is_dir()


def test_a_check_killed_from_outside_keeps_its_report_and_stops_its_child(fake_gpu, tmp_path, monkeypatch):
    """`timeout` sends SIGTERM to the script while a config's child runs (a 2026-11-27 call lost a whole report so):
    the rows measured before stay in the report, the running config's figures are errors, the configs after it are
    not run, the child is killed, and the exit code is 1."""
    import signal
    import subprocess
    import sys
    import threading

    faked = check.run_config
    pid_file = tmp_path / "child.pid"

    def run_config(cfg, out_dir, timeout_s, compile_cache):
        if cfg.name != "e2e_1p5b":
            return faked(cfg, out_dir, timeout_s, compile_cache)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
        subprocess.run([sys.executable, "-c", child], timeout=timeout_s)
        raise AssertionError("the child was not stopped")

    monkeypatch.setattr(check, "run_config", run_config)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = gpu_check_main()(["--work_dir", str(tmp_path / "work"), "--configs", "e2e_7b_lora32,e2e_1p5b,moe_update",
                                 "--out_dir", str(tmp_path / "out")])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 1
    rows = {r["config"]: r for r in check.load_report(str(tmp_path / "report.json"))["results"]}
    assert rows["e2e_7b_lora32_step_s"]["status"] == "ok"
    assert rows["e2e_1p5b_step_s"]["status"] == "error" and "SIGTERM" in rows["e2e_1p5b_step_s"]["error"]
    assert rows["moe_update_3_layers_s"]["status"] == "not run"
    assert (tmp_path / "out" / "report.json").exists()
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped by subprocess.run on the way out
        os.kill(child, 0)


def test_the_report_is_written_after_each_config(fake_gpu, tmp_path, monkeypatch):
    seen = []
    faked = check.run_config

    def run_config(cfg, out_dir, timeout_s, compile_cache):
        path = tmp_path / "report.json"
        seen.append(len(check.load_report(str(path))["results"]) if path.exists() else 0)
        return faked(cfg, out_dir, timeout_s, compile_cache)

    monkeypatch.setattr(check, "run_config", run_config)
    assert gpu_check_main()(["--work_dir", str(tmp_path / "work")]) == 0
    assert seen == [0, 2, 3, 4, 5, 6, 7]  # the 7B LoRA config has two figures


def test_a_multi_gpu_machine_runs_its_seed_share_step_first_and_one_gpu_configs_on_one(monkeypatch):
    assert check.default_configs(1) == check.default_configs(0) == check.DEFAULT
    assert check.default_configs(2) == ("e2e_7b_fsdp2", *check.DEFAULT)
    assert check.default_configs(4) == check.default_configs(8) == ("e2e_7b_fsdp4", *check.DEFAULT)
    assert [c.name for c in check.CONFIGS][:2] == ["e2e_7b_fsdp4", "e2e_7b_fsdp2"]  # they run first
    fsdp4 = next(c for c in check.CONFIGS if c.name == "e2e_7b_fsdp4")
    assert fsdp4.gpus == 4 and fsdp4.args[fsdp4.args.index("--fsdp") + 1] == "4"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert (check.visible_gpus(1), check.visible_gpus(4)) == ("0", "0,1,2,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")  # a machine's own restriction is kept
    assert (check.visible_gpus(1), check.visible_gpus(2)) == ("2", "2,3")


def test_the_four_gpu_step_is_not_run_on_fewer_gpus_and_its_mfu_regresses_when_lower(tmp_path, monkeypatch):
    h200 = "NVIDIA H200"
    base = check.load_baselines()
    recorded = {name: spec["recorded"][h200]["value"] for name, spec in base["figures"].items()
                if name.startswith("e2e_7b_fsdp4") and h200 in spec["recorded"]}
    assert set(recorded) == {"e2e_7b_fsdp4_step_s", "e2e_7b_fsdp4_mfu_update", "e2e_7b_fsdp4_mfu_log_prob"}
    scale, envs = {}, []

    def run_config(cfg, out_dir, timeout_s, compile_cache):
        envs.append(check.visible_gpus(cfg.gpus))
        return [{**f.row, f.key: recorded[f.name] * scale.get(f.name, 1.0)} for f in cfg.figures], h200, None

    monkeypatch.setattr(check, "run_config", run_config)
    monkeypatch.setattr(check, "gpu_name", lambda: h200)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(check, "gpu_count", lambda: 1)
    _, rows = check.check(["e2e_7b_fsdp4"], out_dir=str(tmp_path), budget_s=None, compile_cache="", baselines=base)
    assert [r["status"] for r in rows] == ["not run"] * 3 and "needs 4 GPUs" in rows[0]["note"] and not envs
    monkeypatch.setattr(check, "gpu_count", lambda: 4)
    _, rows = check.check(["e2e_7b_fsdp4"], out_dir=str(tmp_path), budget_s=None, compile_cache="", baselines=base)
    assert [r["status"] for r in rows] == ["ok"] * 3 and envs == ["0,1,2,3"]
    scale["e2e_7b_fsdp4_mfu_update"] = 0.88  # 12% less MFU: higher is better, so this is the regression
    scale["e2e_7b_fsdp4_step_s"] = 0.9  # and a faster step is fine
    _, rows = check.check(["e2e_7b_fsdp4"], out_dir=str(tmp_path), budget_s=None, compile_cache="", baselines=base)
    assert {r["config"]: r["status"] for r in rows} == {
        "e2e_7b_fsdp4_step_s": "ok", "e2e_7b_fsdp4_mfu_update": "regression", "e2e_7b_fsdp4_mfu_log_prob": "ok"}
