"""The GPU check: the recorded headline configs against their figures for this device kind, in one command.

    python scripts/gpu_check.py [--configs e2e_7b_lora32,e2e_1p5b,...] [--budget_s 570] [--record]
    python scripts/gpu_check.py --merge A.json B.json        # one report from two calls (no GPU needed)

Runs each config of `jaxrl_llm/bench/check.py` (a list of benchmark sections) in a child process with a
timeout, in order, while the time budget lasts, sharing one persistent compilation cache; compares each
figure with benchmarks/baselines.json for this device kind (ok: ran, no out-of-memory or error, at most 10%
worse); writes benchmarks/runs/<date>/gpu_check_<commit>_<device>.json ({"meta": {date, device, commit}, "results":
[{config, figure, recorded, ratio, ok}, ...]}), and a copy with the configs' logs under $OUT when it is set.
Exits 1 when a row is not ok. Run it before closing an issue that changes rollout, trainer, models,
algorithms or kernels, and give its result in the closing note.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_llm.bench import check  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(check.DEFAULT),
                    help=f"comma-separated, of {[c.name for c in check.CONFIGS]}")
    ap.add_argument("--budget_s", type=float, default=570.0, help="start no config that would end past this")
    ap.add_argument("--compile_cache", default="/tmp/gpu_check_xla_cache", help="shared by the configs")
    ap.add_argument("--work_dir", default="/tmp/gpu_check", help="each config's rows and log")
    ap.add_argument("--record", action="store_true", help="write this run's figures into benchmarks/baselines.json "
                    "where this device kind has none")
    ap.add_argument("--merge", nargs="+", metavar="REPORT", help="merge reports of one device and commit, then exit")
    args = ap.parse_args(argv)
    if args.merge:
        merged = check.merge(args.merge)
        print(check.write_report(merged["results"], merged["meta"]["device"], meta=merged["meta"]))
        return 0 if all(r["ok"] for r in merged["results"]) else 1
    names = args.configs.split(",")
    unknown = sorted(set(names) - {c.name for c in check.CONFIGS})
    if unknown:
        ap.error(f"unknown config(s) {unknown}; known: {[c.name for c in check.CONFIGS]}")
    os.makedirs(args.work_dir, exist_ok=True)
    baselines = check.load_baselines()
    device, results = check.check(names, out_dir=args.work_dir, budget_s=args.budget_s,
                                  compile_cache=args.compile_cache, baselines=baselines)
    path = check.write_report(results, device)
    if args.record:
        print("recorded:", check.record(results, device, baselines, path,
                                        meta=check.load_report(path)["meta"]))
    if os.environ.get("OUT"):
        shutil.copy(path, os.environ["OUT"])
        shutil.copytree(args.work_dir, os.path.join(os.environ["OUT"], "gpu_check_runs"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.jsonl"))
    print(json.dumps({"report": path, "ok": sum(r["ok"] for r in results), "rows": len(results)}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
