"""The soak check: a long run, killed with SIGKILL and run again with the same command, read back from its run
directory (benchmarks/sessions/soak_issue41.sh makes one).

    python -m jaxrl_llm.bench.soak RUN_DIR [--reference DIR] [--rtol 0] [--out report.json]

A killed run's rows after its last checkpoint are moved aside when it is run again
(`metrics.set-aside-<time>.jsonl`, trainer/loggers.py), and the run logs those steps again: each set-aside file
marks a restart, at the step before its first row. A process's first steps compile and warm up, so the flatness
checks leave out each process's first WARMUP steps. The checks, each "ok", "failed" or "no data":

  peak_memory   perf/max_memory_allocated_gb within `memory_tol` (2%) of its median, after the warm-up
  throughput    perf/throughput within `throughput_tol` (5%) of its median, after the warm-up
  compiles      nothing compiled after a process's first step (perf/compiles, and the engine's programs)
  resumed_equal every step logged twice (by the killed run and by the one after it, or by `--reference`, an
                uninterrupted run) has the same metrics, time and machine figures left out, within `rtol`
                (0: bit for bit, as on a CPU; a GPU's reductions may need a little)

Beside the checks, `checkpoints` lists each save of the final run: the step's wait for it
(timing_s/save_checkpoint: the device-to-host copy; the disk write is Orbax's thread) and the disk the committed ones
took then (perf/checkpoint_*), so a first save that pays for the host buffers shows against the later ones.

Exit 0 when every check is ok, 1 when one failed, 3 when none failed but one had no data.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np

WARMUP = 2  # a process's first steps: compiling, the allocator growing
MACHINE_KEYS = ("timing_s/", "timing_per_token_ms/", "perf/")  # what measures the machine, not the computation
OK, FAILED, NO_DATA = "ok", "failed", "no data"


def read_rows(path: str) -> list[dict]:
    """The rows of a metrics jsonl file (a line a kill cut in half is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return [r for r in rows if isinstance(r, dict) and "step" in r]


def by_step(rows: list[dict]) -> dict[int, dict]:
    """The last row of each step."""
    return {int(r["step"]): r for r in rows}


def restarts(set_aside: list[list[dict]]) -> list[int]:
    """The steps a process started after (0 for the first): a set-aside file's first step, less one."""
    return sorted({0} | {min(int(r["step"]) for r in rows) - 1 for rows in set_aside if rows})


def steady_steps(steps, starts: list[int]) -> list[int]:
    """The steps past their process's warm-up; a step's process started at the latest restart before it."""
    out = []
    for s in sorted(steps):
        start = max(r for r in starts if r < s)
        if s - start > WARMUP:
            out.append(s)
    return out


def flat(final: dict[int, dict], key: str, steps: list[int], tol: float) -> dict:
    values = {s: final[s][key] for s in steps if isinstance(final[s].get(key), (int, float))}
    if not values or not any(values.values()):  # a CPU reports no device memory
        return {"status": NO_DATA, "key": key}
    med = float(np.median(list(values.values())))
    dev = {s: v / med - 1 for s, v in values.items()}
    worst = max(dev, key=lambda s: abs(dev[s]))
    return {"status": OK if abs(dev[worst]) <= tol else FAILED, "key": key, "median": med, "tolerance": tol,
            "worst_step": worst, "worst_deviation": round(dev[worst], 4), "steps": len(values)}


def compiles(final: dict[int, dict], starts: list[int]) -> dict:
    """Compiles at each step after its process's first (perf/compiles; the engine's cumulative program count)."""
    later = [s for s in sorted(final) if s - max(r for r in starts if r < s) > 1]
    if not later or all("perf/compiles" not in final[s] for s in later):
        return {"status": NO_DATA}
    bad = {s: final[s]["perf/compiles"] for s in later if final[s].get("perf/compiles", 0) > 0}
    for s in later:
        prev = final.get(s - 1, {}).get("perf/engine_programs_compiled")
        now = final[s].get("perf/engine_programs_compiled")
        if prev is not None and now is not None and now > prev:
            bad[s] = bad.get(s, 0) + now - prev
    return {"status": FAILED if bad else OK, "steps_checked": len(later), "compiled_at": bad}


def equal(a: dict[int, dict], b: dict[int, dict], rtol: float) -> dict:
    """Metric by metric over the steps both hold (machine figures left out)."""
    steps = sorted(set(a) & set(b))
    if not steps:
        return {"status": NO_DATA}
    worst: dict[str, float] = {}
    for s in steps:
        for k in set(a[s]) & set(b[s]):
            if k.startswith(MACHINE_KEYS) or k == "step":
                continue
            x, y = a[s][k], b[s][k]
            if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                rel = 0.0 if x == y else abs(x - y) / max(abs(x), abs(y), 1e-12)
                worst[k] = max(worst.get(k, 0.0), rel)
    differ = {k: v for k, v in sorted(worst.items(), key=lambda kv: -kv[1]) if v > rtol}
    return {"status": FAILED if differ else OK, "steps": steps, "metrics": len(worst), "rtol": rtol,
            "exact": sum(v == 0 for v in worst.values()), "differ": dict(list(differ.items())[:20])}


def checkpoints(final: dict[int, dict]) -> list[dict]:
    """Each saving step's wait and the disk its checkpointer reported, in step order."""
    keys = {"timing_s/save_checkpoint": "wait_s", "perf/checkpoint_last_gb": "last_gb",
            "perf/checkpoint_kept_gb": "kept_gb", "perf/checkpoint_kept": "kept", "perf/disk_free_gb": "free_gb"}
    return [{"step": s, **{short: final[s][k] for k, short in keys.items() if k in final[s]}}
            for s in sorted(final) if "timing_s/save_checkpoint" in final[s]]


def check(run_dir: str, *, reference: str | None = None, rtol: float = 0.0, memory_tol: float = 0.02,
          throughput_tol: float = 0.05) -> dict:
    """The report of a soaked run (see the module docstring): {check: {status, ...}}, plus `restarts`."""
    final = by_step(read_rows(os.path.join(run_dir, "metrics.jsonl")))
    aside = [read_rows(p) for p in sorted(glob.glob(os.path.join(run_dir, "metrics.set-aside-*.jsonl")))]
    starts = restarts(aside)
    steady = steady_steps(final, starts)
    if reference is not None:
        twice = equal(by_step(read_rows(os.path.join(reference, "metrics.jsonl"))), final, rtol)
    else:  # each killed run's steps after its checkpoint, against the run after it that logged them again
        parts = [equal(by_step(rows), final, rtol) for rows in aside]
        parts = [p for p in parts if p["status"] != NO_DATA]
        twice = {"status": NO_DATA} if not parts else {
            "status": FAILED if any(p["status"] == FAILED for p in parts) else OK, "rtol": rtol,
            "steps": sorted({s for p in parts for s in p["steps"]}),
            "differ": {k: v for p in parts for k, v in p["differ"].items()}}
    return {"steps": sorted(final), "restarts": starts[1:],
            "peak_memory": flat(final, "perf/max_memory_allocated_gb", steady, memory_tol),
            "throughput": flat(final, "perf/throughput", steady, throughput_tol),
            "compiles": compiles(final, starts), "resumed_equal": twice, "checkpoints": checkpoints(final)}


def exit_code(report: dict) -> int:
    statuses = [v["status"] for v in report.values() if isinstance(v, dict)]
    return 1 if FAILED in statuses else 3 if NO_DATA in statuses else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_llm.bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--reference", help="an uninterrupted run's dir to compare every step with")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance of resumed_equal (0: exact)")
    ap.add_argument("--memory_tol", type=float, default=0.02)
    ap.add_argument("--throughput_tol", type=float, default=0.05)
    ap.add_argument("--out", help="also write the report here (JSON)")
    args = ap.parse_args(argv)
    report = check(args.run_dir, reference=args.reference, rtol=args.rtol, memory_tol=args.memory_tol,
                   throughput_tol=args.throughput_tol)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return exit_code(report)


if __name__ == "__main__":
    sys.exit(main())
