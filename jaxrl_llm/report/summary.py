"""The report's numbers (reward, validation, tool use, KL, step time by phase, throughput) and summary.md."""

from __future__ import annotations

import os

import numpy as np

from jaxrl_llm.report.metrics import ASYNC_COUNTS, ASYNC_KEYS, RunMetrics, is_num
from jaxrl_llm.report.plots import KL_KEYS


def _point(steps: np.ndarray, vals: np.ndarray, i) -> dict:
    return {"step": int(steps[i]), "value": float(vals[i])}


def _first_last_best(run: RunMetrics, key: str) -> dict | None:
    """First, last and best (highest; the earliest on a tie) finite value of `key`, with their steps."""
    steps, vals = run.series(key)
    ok = np.flatnonzero(np.isfinite(vals))
    if not len(ok):
        return None
    return {"first": _point(steps, vals, ok[0]), "last": _point(steps, vals, ok[-1]),
            "best": _point(steps, vals, np.nanargmax(vals))}


def _finite_mean(records: list[dict], key: str) -> float | None:
    vals = [float(r[key]) for r in records if is_num(r.get(key)) and np.isfinite(r[key])]
    return float(np.mean(vals)) if vals else None


def _step_time(run: RunMetrics) -> dict | None:
    """Mean timing_s/step and each phase's share of it. The first step is left out when there are more:
    it includes JIT compilation and would dominate the mean of a short run."""
    timed = [r for r in run.train if is_num(r.get("timing_s/step")) and np.isfinite(r["timing_s/step"])]
    if not timed:
        return None
    excluded = timed[0]["step"] if len(timed) > 1 else None
    timed = timed[1:] if len(timed) > 1 else timed
    mean = float(np.mean([r["timing_s/step"] for r in timed]))
    # A phase missing from a step did not run in it (ref, save_checkpoint): it counts as 0 s there.
    phases = {p: float(np.mean([r[k] if is_num(r.get(k)) and np.isfinite(r[k]) else 0.0 for r in timed]))
              for p in run.phases() for k in [f"timing_s/{p}"]}
    pct = {p: 100 * s / mean if mean > 0 else 0.0 for p, s in phases.items()}
    return {"mean_s": mean, "steps": [timed[0]["step"], timed[-1]["step"]], "excluded_step": excluded,
            "phases_s": phases, "phases_pct": pct, "other_pct": 100 - sum(pct.values()) if phases else None}


def _compiles(run: RunMetrics) -> dict | None:
    """XLA compiles (`perf/compiles`, `perf/compile_s`) in the first step and in all later ones together, and
    which later steps compiled (a run whose program shapes are all built ahead compiles nothing after its
    first step); None where the run does not log them."""
    steps, counts = run.series("perf/compiles")
    if not len(steps):
        return None
    _, secs = run.series("perf/compile_s")
    secs = secs if len(secs) == len(steps) else np.zeros(len(steps))
    counts, secs = np.nan_to_num(counts), np.nan_to_num(secs)
    later = slice(1, None)
    return {"first": {"step": int(steps[0]), "compiles": int(counts[0]), "compile_s": float(secs[0])},
            "later": {"steps": [int(steps[1]), int(steps[-1])] if len(steps) > 1 else None,
                      "compiles": int(counts[later].sum()), "compile_s": float(secs[later].sum()),
                      "compiled_in": [int(s) for s, c in zip(steps[later], counts[later]) if c > 0]}}


def _async_stats(run: RunMetrics) -> dict:
    """An async run's metrics: {key: first, last (points), mean} of those it logs, and each count's total over
    the run ("totals"); {} for a synchronous run."""
    out: dict = {}
    for key in ASYNC_KEYS:
        if run.has(key):
            points = _first_last_best(run, key)
            out[key] = {"first": points["first"], "last": points["last"], "mean": float(np.nanmean(run.series(key)[1]))}
    totals = {k: float(np.nansum(run.series(k)[1])) for k in ASYNC_COUNTS if run.has(k)}
    return {**out, "totals": totals} if out else {}


def compute_stats(run: RunMetrics, last_n: int) -> dict:
    """The key numbers of a run, as plain Python values (the dict write_report returns, less its paths)."""
    tail = run.train[-last_n:]
    steps = [r["step"] for r in run.train]
    return {
        "num_steps": len(run.train),
        "steps": [steps[0], steps[-1]] if steps else None,
        "reward": _first_last_best(run, "critic/score/mean"),
        "validation": {label: {"key": key, **_first_last_best(run, key)} for key, label in run.val_keys().items()},
        "final_kl": {k: _first_last_best(run, k)["last"] for k in KL_KEYS if run.has(k)},
        "tool_use": {k: _first_last_best(run, k) for k in TOOL_KEYS if run.has(k)},
        "step_time": _step_time(run),
        "async": _async_stats(run),
        "compiles": _compiles(run),
        "last_n": {"n": len(tail), "steps": [tail[0]["step"], tail[-1]["step"]] if tail else None,
                   "throughput": _finite_mean(tail, "perf/throughput"), "mfu": _finite_mean(tail, "perf/mfu/actor"),
                   "pack_fill": _finite_mean(tail, "perf/pack_fill")},
        "skipped_steps": {k: float(np.nansum(run.series(k)[1])) for k in ("actor/skipped_steps", "critic/skipped_steps")
                          if run.has(k)},
        "nonfinite": dict(run.nonfinite()),
    }


TOOL_KEYS = ("multi_turn/tool_calls_mean", "multi_turn/turns_mean")  # a multi-turn run's tool use


def _g(x: float) -> str:
    return f"{x:.4g}"


def render_summary(run_dir: str, stats: dict, plots: dict[str, str], skipped: dict[str, str],
                   notes: list[str], out_dir: str) -> str:
    """summary.md: the key numbers, links to the plots (relative to out_dir), and what was skipped."""
    steps = f" (steps {stats['steps'][0]}–{stats['steps'][1]})" if stats["steps"] else ""
    md = [f"# Run report: {os.path.basename(os.path.abspath(run_dir))}", "",
          f"- Run dir: `{os.path.abspath(run_dir)}`", f"- Training steps: {stats['num_steps']}{steps}"]
    if "overview" in plots:
        md += ["", f"![overview]({os.path.relpath(plots['overview'], out_dir)})"]

    md += ["", "## Train reward (critic/score/mean)", ""]
    if r := stats["reward"]:
        md += ["| | step | value |", "|---|---:|---:|"]
        md += [f"| {w} | {r[w]['step']} | {_g(r[w]['value'])} |" for w in ("first", "last", "best")]
    else:
        md.append("No critic/score/mean in this run.")

    md += ["", "## Validation", ""]
    if stats["validation"]:
        md += ["| data source | last (step) | best (step) |", "|---|---:|---:|"]
        md += [f"| {label} | {_g(v['last']['value'])} ({v['last']['step']}) | {_g(v['best']['value'])} "
               f"({v['best']['step']}) |" for label, v in stats["validation"].items()]
    else:
        md.append("No val-core/<data_source>/.../mean@N metrics in this run.")

    if stats["tool_use"]:  # multi-turn runs: tool calls and turns a response
        md += ["", "## Tool use (a response)", "", "| metric | first (step) | last (step) | best (step) |",
               "|---|---:|---:|---:|"]
        md += [f"| {k} | " + " | ".join(f"{_g(v[w]['value'])} ({v[w]['step']})" for w in ("first", "last", "best"))
               + " |" for k, v in stats["tool_use"].items()]

    md += ["", "## Final KL", ""]
    md += [f"- {k}: {_g(p['value'])} (step {p['step']})" for k, p in stats["final_kl"].items()] or [
        f"No KL metric ({', '.join(KL_KEYS)}) in this run."]

    md += ["", "## Time per step", ""]
    if t := stats["step_time"]:
        left_out = f"; step {t['excluded_step']} (JIT compilation) left out" if t["excluded_step"] is not None else ""
        md.append(f"Mean timing_s/step {_g(t['mean_s'])} s over steps {t['steps'][0]}–{t['steps'][1]}{left_out}.")
        if t["phases_s"]:
            md += ["", "| phase | mean s | % of step |", "|---|---:|---:|"]
            md += [f"| {p} | {_g(s)} | {t['phases_pct'][p]:.1f} |" for p, s in t["phases_s"].items()]
            md.append(f"| other (not in a phase) | | {t['other_pct']:.1f} |")
    else:
        md.append("No timing_s/step in this run.")

    if a := stats["async"]:  # one_step_off and fully_async runs
        rows = [k for k in a if k != "totals"]
        md += ["", "## Asynchronous training", "", "| metric | first (step) | last (step) | mean |",
               "|---|---:|---:|---:|"]
        md += [f"| {k} | {_g(a[k]['first']['value'])} ({a[k]['first']['step']}) | {_g(a[k]['last']['value'])} "
               f"({a[k]['last']['step']}) | {_g(a[k]['mean'])} |" for k in rows]
        if a["totals"]:
            md += ["", "Totals over the run: " + ", ".join(f"{k} {_g(v)}" for k, v in a["totals"].items()) + "."]

    n = stats["last_n"]
    md += ["", f"## Throughput (mean over the last {n['n']} training steps)", ""]
    if n["n"]:
        thr, mfu, fill = n["throughput"], n["mfu"], n.get("pack_fill")
        md.append(f"Steps {n['steps'][0]}–{n['steps'][1]}: perf/throughput "
                  f"{_g(thr) + ' tokens/s/device' if thr is not None else 'not logged'}, perf/mfu/actor "
                  f"{f'{_g(mfu)} ({100 * mfu:.2f}%)' if mfu is not None else 'not logged'}"
                  f"{f', perf/pack_fill {fill:.3f}' if fill is not None else ''}.")

    md += ["", "## Compiles (perf/compiles, perf/compile_s)", ""]
    if c := stats.get("compiles"):
        first, later = c["first"], c["later"]
        md += ["| steps | compiles | compile s |", "|---|---:|---:|",
               f"| first ({first['step']}) | {first['compiles']} | {_g(first['compile_s'])} |"]
        if later["steps"]:
            md.append(f"| later ({later['steps'][0]}–{later['steps'][1]}) | {later['compiles']} | "
                      f"{_g(later['compile_s'])} |")
            md += ["", "Later steps that compiled: " + (", ".join(map(str, later["compiled_in"])) or "none") + "."]
    else:
        md.append("No perf/compiles in this run.")

    md += ["", "## Skipped steps", ""]
    md += [f"- {k} total: {_g(v)}" for k, v in stats["skipped_steps"].items()] or ["No skipped_steps metric."]

    md += ["", "## Plots", ""]
    md += [f"- [{name}]({os.path.relpath(path, out_dir)})" for name, path in plots.items()] or ["None drawn."]
    if skipped:
        md += ["", "## Skipped panels", ""] + [f"- {name}: {why}" for name, why in skipped.items()]
    notes = notes + [f"{k}: {c} non-finite value(s), left out of the numbers (gaps in the plots)"
                     for k, c in sorted(stats["nonfinite"].items())]
    if notes:
        md += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    return "\n".join(md) + "\n"
