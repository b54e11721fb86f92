"""The GPU check: the recorded headline configs, each a list of benchmark sections run in a child process
with a timeout, compared with the figures recorded for this device kind in benchmarks/baselines.json.

A result row is {config, figure, recorded, ratio, status, ok} (plus unit, source, error and note): `figure` is the
measured value, `ratio` figure / recorded (time: higher is slower), and `status` one of
  "ok"           measured, at most `tolerance` (10%) worse than recorded;
  "regression"   measured, more than `tolerance` worse;
  "error"        an out-of-memory, an error, a timeout or a missing row;
  "not run"      the time budget ran out before its config started (a second call runs it);
  "no baseline"  measured, but nothing is recorded for this device kind to compare with (`--record` adds it).
`ok` is status == "ok". `verdict` turns the rows into the exit code: 0 when every row is ok, 1 on a regression or
an error, 3 when none failed but some were not run or had no baseline (not a pass). One config failing does not
stop the others.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import time

from jaxrl_llm.bench.harness import REPO, commit, commit_of_tree, tree

BASELINES = os.path.join(REPO, "benchmarks", "baselines.json")
E2E = ("--sections", "e2e", "--remat", "auto", "--token_budget", "16384", "--steps", "2")


@dataclasses.dataclass(frozen=True)
class Figure:
    """A measured figure: the value under `key` in the first row that has every item of `row`."""

    name: str
    row: dict
    key: str


@dataclasses.dataclass(frozen=True)
class Config:
    """One child process: `python -m jaxrl_llm.bench *args`, its figures, and its expected seconds on a cold
    compilation cache (what the time budget plans with; the timeout is TIMEOUT_FACTOR times it). `gpus`: the GPUs it
    runs on (the first `gpus` of the machine's: a one-GPU config on a 4-GPU machine sees one); a machine with fewer
    does not run it."""

    name: str
    args: tuple[str, ...]
    figures: tuple[Figure, ...]
    expected_s: float
    gpus: int = 1


def _step1(key: str, name: str) -> Figure:
    return Figure(name, {"section": "e2e", "step": 1}, key)


def _seed_share(gpus: int) -> Config:
    """Issue 40's figures: the 7B GRPO step at the seed's per-GPU share over `gpus` GPUs at fsdp `gpus`, full
    fine-tuning, with XLA's overlap flags (as BENCHMARKS.md's headline ran): its wall seconds and the MFU of the
    update and of the log-prob passes (higher is better)."""
    tag = f"e2e_7b_fsdp{gpus}"
    return Config(tag, E2E + ("--train_presets", "qwen2p5_7b", "--kv_cache", "paged", "--fsdp", str(gpus),
                              "--xla_gpu_overlap"),
                  (_step1("wall_s", f"{tag}_step_s"), _step1("perf/mfu/actor", f"{tag}_mfu_update"),
                   _step1("perf/mfu/log_prob", f"{tag}_mfu_log_prob")), 300, gpus=gpus)


CONFIGS = (  # the order they run in: a multi-GPU machine's own step first, then the 7B LoRA step (issue 32's)
    _seed_share(4),
    _seed_share(2),
    Config("e2e_7b_lora32", E2E + ("--train_presets", "qwen2p5_7b", "--lora_rank", "32"),
           (_step1("wall_s", "e2e_7b_lora32_step_s"), _step1("timing_s/gen", "gen_7b_seed_share_in_step_s")), 260),
    Config("e2e_1p5b", E2E + ("--train_presets", "qwen2p5_1p5b"), (_step1("wall_s", "e2e_1p5b_step_s"),), 150),
    Config("moe_update", ("--sections", "moe_update", "--layers", "3"),
           (Figure("moe_update_3_layers_s", {"section": "moe_update", "layers": 3}, "seconds"),), 90),
    Config("e2e_qwen3_1p7b", E2E + ("--train_presets", "qwen3_1p7b"), (_step1("wall_s", "e2e_qwen3_1p7b_step_s"),),
           160),
    Config("gen_qwen3_8b", ("--sections", "gen", "--presets", "qwen3_8b", "--engines", "paged", "--repeats", "1"),
           (Figure("gen_qwen3_8b_seed_share_s", {"section": "gen", "rep": 1}, "seconds"),), 290),
    Config("gen_7b", ("--sections", "gen", "--presets", "qwen2p5_7b", "--engines", "paged", "--repeats", "1"),
           (Figure("gen_7b_seed_share_s", {"section": "gen", "rep": 1}, "seconds"),), 200),
    # Qwen3.5 (issue 43): the 9B's generation at 256 rows at once (at its own slot cap it ran out of memory on an
    # H100, BENCHMARKS.md), and its LoRA step.
    Config("gen_qwen3_5_9b", ("--sections", "gen", "--presets", "qwen3_5_9b", "--engines", "paged", "--repeats", "1",
                              "--max_num_seqs", "256"),
           (Figure("gen_qwen3_5_9b_seed_share_s", {"section": "gen", "rep": 1}, "seconds"),), 300),  # cut at 237 s,
    # cold, at 6bbed0a: every program was built for two pools (the engine now probes the widest first)
    # Cold on an H100 (2026-11-28, b21d176): the trainer built in 259 s and step 0 took 248 s (200 s of it building
    # the engine's 36 programs), so step 1 ended past 565 s; on the machine it had warmed, 184 s in all. A cold
    # machine runs it in a call of its own (`--configs e2e_qwen3_5_9b_lora32 --budget_s 590`).
    Config("e2e_qwen3_5_9b_lora32", E2E + ("--train_presets", "qwen3_5_9b", "--lora_rank", "32"),
           (_step1("wall_s", "e2e_qwen3_5_9b_lora32_step_s"),), 580),
    # The 9B's training passes alone (no engine: a third of the step's cold build), with the chunked gated delta
    # kernel: the LoRA update and the fused log-prob passes at the seed's share (2026-11-28 on an H200: 176 s warm;
    # cold, the update's compile ran past 245 s). Remat `auto` chooses by the device's memory, so each device kind
    # records its own; outside the default list.
    Config("train_qwen3_5_9b_lora32", ("--sections", "profile_update", "--train_presets", "qwen3_5_9b",
                                       "--lora_rank", "32", "--remat", "auto", "--token_budget", "16384"),
           (Figure("train_qwen3_5_9b_lora32_update_s", {"section": "update", "preset": "qwen3_5_9b"}, "seconds"),
            Figure("train_qwen3_5_9b_lora32_log_prob_s", {"section": "log_prob_pass", "preset": "qwen3_5_9b"},
                   "seconds")), 360),
    # MoE at the full share (issue 43): Qwen3-30B-A3B's LoRA step at 128 prompts x 5 on one H200 (the engine reads
    # the frozen experts in place). Cold it took 500 s in all (built in 141 s, step 0 301 s: 1,797 s of decode and
    # prefill compiles on threads), so it is not in the default list: a call of its own on an H200.
    Config("e2e_qwen3_30b_a3b_lora32", E2E + ("--train_presets", "qwen3_30b_a3b", "--lora_rank", "32"),
           (_step1("wall_s", "e2e_qwen3_30b_a3b_lora32_step_s"),), 540),
    # Qwen3.5-35B-A3B's LoRA step at the same share (issue 43), outside the default list too. Its programs take
    # longer to build than a call lasts (cold on an H200 at c27e62e, 2026-12-02: the trainer built in 550 s, 59
    # programs, 2,690 s on threads), so it runs on a compilation cache: a cold machine runs it twice, back to back
    # (`--configs e2e_qwen3_5_35b_a3b_lora32 --budget_s 590`), the first call filling the cache; on that cache the
    # build took 68 s and the whole run 197 s.
    Config("e2e_qwen3_5_35b_a3b_lora32", E2E + ("--train_presets", "qwen3_5_35b_a3b", "--lora_rank", "32"),
           (_step1("wall_s", "e2e_qwen3_5_35b_a3b_lora32_step_s"),), 390),
)
DEFAULT = ("e2e_7b_lora32", "e2e_1p5b", "moe_update", "e2e_qwen3_1p7b", "gen_qwen3_8b", "gen_qwen3_5_9b",
           "e2e_qwen3_5_9b_lora32")
# On a machine of several GPUs: the seed-share step over 4 of them where it has 4, else over 2 (issue 40).
MULTI = {4: "e2e_7b_fsdp4", 2: "e2e_7b_fsdp2"}


def default_configs(gpus: int) -> tuple[str, ...]:
    """What a call without --configs runs on a machine of `gpus` GPUs: the one-GPU list alone on one GPU; on
    several, also the multi-GPU step (it runs first, CONFIGS' order), then the one-GPU list on the first GPU."""
    multi = next((MULTI[n] for n in sorted(MULTI, reverse=True) if gpus >= n), None)
    return ((multi,) if multi else ()) + DEFAULT
TIMEOUT_FACTOR = 1.5  # a config's timeout: this times its expected seconds


def load_baselines(path: str = BASELINES) -> dict:
    with open(path) as f:
        return json.load(f)


def find(rows: list[dict], fig: Figure):
    """(value, error): the figure's value in `rows`, or None and why not."""
    for r in rows:
        if all(r.get(k) == v for k, v in fig.row.items()) and fig.key in r:
            return r[fig.key], None
    errors = [r["error"] for r in rows if "error" in r]
    return None, (errors[0] if errors else f"no row with {fig.row} and {fig.key!r}")


OK, REGRESSION, ERROR, NOT_RUN, NO_BASELINE = "ok", "regression", "error", "not run", "no baseline"
RECORDED = "recorded"  # measured where nothing was recorded, and written as the device's baseline (--record)
EXIT_OK, EXIT_FAILED, EXIT_INCOMPLETE = 0, 1, 3


def _row(fig: Figure, value, device: str, baselines: dict, source_run: str, status: str, **extra) -> dict:
    spec = baselines["figures"].get(fig.name, {})
    rec = spec.get("recorded", {}).get(device)
    return {"config": fig.name, "figure": value, "recorded": rec["value"] if rec else None, "ratio": None,
            "unit": spec.get("unit", "s"), "run": source_run, "status": status, "ok": status == OK, **extra}


def compare(fig: Figure, value, error, device: str, baselines: dict, source_run: str) -> dict:
    """One result row: the measured figure against the recorded one for `device`."""
    if error is not None or value is None:
        return _row(fig, value, device, baselines, source_run, ERROR, error=str(error)[:500])
    spec = baselines["figures"].get(fig.name, {})
    rec = spec.get("recorded", {}).get(device)
    if rec is None:
        return _row(fig, value, device, baselines, source_run, NO_BASELINE,
                    note=f"nothing recorded for {device}: measured, not compared (--record adds it)")
    ratio = value / rec["value"]
    worse = ratio > 1 + baselines["tolerance"] if spec.get("better", "lower") == "lower" else \
        ratio < 1 - baselines["tolerance"]
    return {**_row(fig, value, device, baselines, source_run, REGRESSION if worse else OK), "ratio": round(ratio, 3),
            "source": rec.get("source")}


def not_run(fig: Figure, reason: str, device: str, baselines: dict, source_run: str) -> dict:
    """The row of a figure whose config was not started: neither a pass nor a failure."""
    return _row(fig, None, device, baselines, source_run, NOT_RUN, note=reason)


def status_of(row: dict) -> str:
    """A row's status; reports written before rows had one say only `ok` (and "not run: ..." in `error`)."""
    if "status" in row:
        return row["status"]
    if row.get("ok"):
        return OK
    return NOT_RUN if str(row.get("error", "")).startswith("not run") else ERROR


def verdict(results: list[dict]) -> tuple[int, dict[str, int]]:
    """(exit code, rows by status): 0 every row ok or recorded as the baseline in its call; 1 a regression or an
    error; 3 none failed, but a row was not run or had nothing to compare with (no pass either: a check with no rows
    is incomplete too)."""
    counts: dict[str, int] = {}
    for row in results:
        counts[status_of(row)] = counts.get(status_of(row), 0) + 1
    if counts.get(REGRESSION) or counts.get(ERROR):
        return EXIT_FAILED, counts
    passed = counts.get(OK, 0) + counts.get(RECORDED, 0)
    return (EXIT_OK if results and passed == len(results) else EXIT_INCOMPLETE), counts


def run_config(cfg: Config, out_dir: str, timeout_s: float, compile_cache: str):
    """Runs `cfg` in a child process on the machine's first `cfg.gpus` GPUs; (its rows, its device kind or None, an
    error or None)."""
    out = os.path.join(out_dir, cfg.name)
    cmd = [sys.executable, "-m", "jaxrl_llm.bench", *cfg.args, "--out", out, "--compile_cache", compile_cache]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_gpus(cfg.gpus)}
    error = None
    with open(os.path.join(out_dir, f"{cfg.name}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env=env).returncode
            error = f"process exited {rc}" if rc else None
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout_s:.0f} s"
    path = os.path.join(out, "bench.json")
    if not os.path.exists(path):
        return [], None, error or "no results written"
    with open(path) as f:
        got = json.load(f)
    return got["results"], got["meta"].get("device"), error


def visible_gpus(n: int) -> str:
    """CUDA_VISIBLE_DEVICES for a child on the first `n` GPUs: of those this process was given, if it was given some."""
    given = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(given[:n] if given else (str(i) for i in range(n)))


def gpu_count() -> int:
    """The GPUs nvidia-smi lists (0 without a driver), limited to CUDA_VISIBLE_DEVICES where that is set."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    except FileNotFoundError:
        return 0
    listed = sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0
    given = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return min(listed, len(given)) if given else listed


def gpu_name() -> str:
    """The first GPU's name as nvidia-smi gives it (jax's device_kind), without starting JAX here: this process
    must not hold the memory its configs' processes need."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True)
    except FileNotFoundError:  # no NVIDIA driver here
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def default_budget_s(names) -> float:
    """Time for every config of `names` to run to its timeout (1.5 times its expected seconds): a call with the
    default budget starts every config it was given."""
    return sum(TIMEOUT_FACTOR * c.expected_s for c in CONFIGS if c.name in names)


class Stopped(Exception):
    """Raised in the check's process by a signal (scripts/gpu_check.py turns SIGTERM, what `timeout` sends, into
    it): the config running is stopped, its child killed, and the report keeps every row measured before."""


def check(names, *, out_dir: str, budget_s: float | None, compile_cache: str, baselines: dict,
          on_rows=None) -> tuple[str, list[dict]]:
    """Runs the configs `names` in the order named within `budget_s` seconds (None: `default_budget_s`), so that a
    call runs first what it names first (a config whose programs an earlier call cached); (the device kind, the
    result rows of all their figures). `on_rows(device, rows)` is called after each config with the rows so far (the
    script writes its report there, so that a call killed from outside loses only the config it was running); a
    `Stopped` raised while a config runs makes its figures errors and the configs after it not run."""
    budget_s = default_budget_s(names) if budget_s is None else budget_s
    t_end = time.monotonic() + budget_s
    device, results, stopped, gpus = gpu_name(), [], None, gpu_count()
    by_name = {c.name: c for c in CONFIGS}
    for cfg in (by_name[n] for n in dict.fromkeys(names)):
        left = t_end - time.monotonic()
        if cfg.gpus > max(gpus, 1):
            results.extend(not_run(fig, f"it needs {cfg.gpus} GPUs and this machine has {gpus} (run it on a "
                                        f"{cfg.gpus}-GPU kind)", device, baselines, cfg.name) for fig in cfg.figures)
            continue
        if stopped is not None:
            results.extend(not_run(fig, f"the check was stopped ({stopped}) before it (run it alone with "
                                        f"--configs {cfg.name})", device, baselines, cfg.name) for fig in cfg.figures)
            continue
        if left < cfg.expected_s:
            for fig in cfg.figures:
                results.append(not_run(fig, f"{left:.0f} s of the time budget left, it takes about "
                                            f"{cfg.expected_s:.0f} s (run it alone with --configs {cfg.name})",
                                       device, baselines, cfg.name))
            continue
        t0 = time.monotonic()
        try:
            rows, kind, error = run_config(cfg, out_dir, min(TIMEOUT_FACTOR * cfg.expected_s, left), compile_cache)
        except Stopped as e:  # subprocess.run killed the child on the way out
            stopped = str(e)
            rows, kind, error = [], None, f"stopped after {time.monotonic() - t0:.0f} s ({e})"
        device = kind or device
        print(f"gpu_check: {cfg.name} in {time.monotonic() - t0:.0f} s{f' ({error})' if error else ''}", flush=True)
        for fig in cfg.figures:
            value, missing = find(rows, fig)
            results.append(compare(fig, value, error or (missing if value is None else None), device, baselines,
                                   cfg.name))
            print("gpu_check:", json.dumps(results[-1]), flush=True)
        if on_rows is not None:
            on_rows(device, results)
    return device, results


def device_slug(device: str) -> str:
    """A short file-name tag for a device kind: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'."""
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", device or "")
    return (m.group(1) if m else re.sub(r"[^0-9a-z]+", "_", (device or "unknown").lower()).strip("_")).lower()


def report_path(date: str, sha: str, device: str) -> str:
    """benchmarks/runs/<date>/gpu_check_<commit>_<device>.json: one report per device kind and commit, so that
    the H100's and the H200's checks of one commit sit side by side."""
    name = f"gpu_check_{sha.replace('+', '-')}_{device_slug(device)}.json"  # the device tool returns no '+' name
    return os.path.join(REPO, "benchmarks", "runs", date, name)


def write_report(results: list[dict], device: str, path: str | None = None, *, meta: dict | None = None) -> str:
    """Writes the report. `meta` defaults to this run's: today, `device`, this tree's commit and the files' git tree
    (`harness.tree`); a merge passes its reports'."""
    meta = meta or {"date": datetime.date.today().isoformat(), "device": device, "commit": commit(), "tree": tree()}
    path = path or report_path(meta["date"], meta["commit"], device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    return path


def load_report(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def merge(paths: list[str]) -> dict:
    """Reports of one device and commit in several calls as one: a later row of a figure replaces an earlier."""
    reports = [load_report(p) for p in paths]
    metas = {(r["meta"]["device"], r["meta"]["commit"], r["meta"].get("tree")) for r in reports}
    if len(metas) != 1:
        raise ValueError(f"gpu_check --merge: the reports are of different devices or commits: {sorted(metas)}")
    by_figure: dict[str, dict] = {}
    for r in reports:
        for row in r["results"]:
            by_figure[row["config"]] = row
    return {"meta": named_commit(reports[-1]["meta"]), "results": list(by_figure.values())}


def named_commit(meta: dict) -> dict:
    """The meta with the commit whose files ran, found by their tree here (a lent machine's copy can sit on an
    older commit and read '<old>+dirty'); what its git said stays as `ran_as`."""
    found = commit_of_tree(meta.get("tree"))
    if not found or found == meta["commit"]:
        return meta
    return {**meta, "commit": found, "ran_as": meta.get("ran_as", meta["commit"])}


def record(results: list[dict], device: str, baselines: dict, report: str, path: str | None = None,
           meta: dict | None = None) -> list[str]:
    """Writes the figures measured here that have nothing recorded for `device`; returns their names. `meta` (the
    report's) stamps each with its commit and date. The caller marks their rows `RECORDED` (`mark_recorded`)."""
    added = []
    for row in results:
        spec = baselines["figures"].get(row["config"])
        if spec is None or status_of(row) not in (OK, NO_BASELINE) or row["figure"] is None \
                or device in spec["recorded"]:
            continue
        stamp = {k: meta[k] for k in ("commit", "date") if meta and meta.get(k)}
        spec["recorded"][device] = {"value": round(row["figure"], 4), **stamp,
                                    "source": f"{os.path.relpath(report, REPO)} ({row['config']})"}
        added.append(row["config"])
    with open(path or BASELINES, "w") as f:
        f.write(dump_baselines(baselines))
    return added


def mark_recorded(results: list[dict], recorded: list[str]) -> list[dict]:
    """The rows of the figures `record` wrote as passing, `RECORDED`: so the report says so, and a merge of it with
    a later call's report still passes them (as "no baseline" it would exit 3)."""
    return [{**r, "status": RECORDED, "ok": True} if r["config"] in recorded else r for r in results]


def dump_baselines(baselines: dict) -> str:
    """baselines.json as the file keeps it: one line per recorded figure, so a diff shows what was recorded."""
    def one(v) -> str:
        return json.dumps(v, ensure_ascii=False)

    lines = ["{"] + [f" {one(k)}: {one(v)}," for k, v in baselines.items() if k != "figures"] + [' "figures": {']
    figures = list(baselines["figures"].items())
    for i, (name, spec) in enumerate(figures):
        lines.append(f"  {one(name)}: {{")
        plain = [(k, v) for k, v in spec.items() if k not in ("recorded", "unit", "better")]
        lines += [f"   {one(k)}: {one(v)}," for k, v in plain]
        if "unit" in spec or "better" in spec:
            lines.append("   " + ", ".join(f"{one(k)}: {one(spec[k])}" for k in ("unit", "better") if k in spec) + ",")
        recorded = list(spec.get("recorded", {}).items())
        lines.append('   "recorded": {')
        lines += [f"    {one(d)}: {one(v)}" + ("," if j < len(recorded) - 1 else "")
                  for j, (d, v) in enumerate(recorded)]
        lines += ["   }", "  }" + ("," if i < len(figures) - 1 else "")]
    return "\n".join(lines + [" }", "}", ""])
