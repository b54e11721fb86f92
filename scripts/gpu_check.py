"""The GPU check: the recorded headline configs against their figures for this device kind, in one command.

    python scripts/gpu_check.py [--configs e2e_7b_lora32,e2e_1p5b,...] [--budget_s S] [--record] [--out_dir DIR]
    python scripts/gpu_check.py --merge A.json B.json        # one report from two calls (no GPU needed)

Runs each config of `jaxrl_llm/bench/check.py` (a list of benchmark sections) in a child process with a
timeout, in order, while the time budget lasts (default: every config's timeout added up, so that all of them
start; a call limited in time passes less, and the configs it does not reach are "not run"), sharing one
persistent compilation cache; compares each figure with benchmarks/baselines.json for this device kind; writes
benchmarks/runs/<date>/gpu_check_<commit>_<device>.json ({"meta": {date, device, commit}, "results":
[{config, figure, recorded, ratio, status, ok}, ...]}), and with --out_dir a copy of it and the configs' logs there.
Exits 0 when every row is ok, 1 on a regression or an error, 3 when none failed but some were not run or had no
baseline for this device (not a pass: run the rest, or --record). Run it before closing an issue that changes
rollout, trainer, models, algorithms or kernels, and give its result in the closing note.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_llm.bench import check  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated, of {[c.name for c in check.CONFIGS]} (default: {', '.join(check.DEFAULT)}; "
                    f"on several GPUs, first {' or '.join(check.MULTI.values())}, over 4 of them or 2)")
    ap.add_argument("--budget_s", type=float, default=None,
                    help="start no config that would end past this (default: every config's timeout added up)")
    ap.add_argument("--compile_cache", default="/tmp/gpu_check_xla_cache", help="shared by the configs")
    ap.add_argument("--work_dir", default="/tmp/gpu_check", help="each config's rows and log")
    ap.add_argument("--record", action="store_true", help="write this run's figures into benchmarks/baselines.json "
                    "where this device kind has none")
    ap.add_argument("--merge", nargs="+", metavar="REPORT", help="merge reports of one device and commit, then exit")
    ap.add_argument("--out_dir", default=None, help="also copy the report and the configs' logs here")
    args = ap.parse_args(argv)
    if args.merge:
        merged = check.merge(args.merge)
        print(check.write_report(merged["results"], merged["meta"]["device"], meta=merged["meta"]))
        return check.verdict(merged["results"])[0]
    names = args.configs.split(",") if args.configs else list(check.default_configs(check.gpu_count()))
    unknown = sorted(set(names) - {c.name for c in check.CONFIGS})
    if unknown:
        ap.error(f"unknown config(s) {unknown}; known: {[c.name for c in check.CONFIGS]}")
    os.makedirs(args.work_dir, exist_ok=True)
    baselines = check.load_baselines()

    def stop(signum, frame):  # `timeout` (or the lent machine's limit) sends SIGTERM: keep what was measured
        raise check.Stopped(f"signal {signal.Signals(signum).name}")

    def save_so_far(device, rows):  # the report after each config, for a call killed past its last
        path = check.write_report(rows, device)
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            shutil.copy(path, args.out_dir)

    signal.signal(signal.SIGTERM, stop)
    device, results = check.check(names, out_dir=args.work_dir, budget_s=args.budget_s,
                                  compile_cache=args.compile_cache, baselines=baselines, on_rows=save_so_far)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    path = check.write_report(results, device)
    recorded = []
    if args.record:
        meta = check.load_report(path)["meta"]
        recorded = check.record(results, device, baselines, path, meta=meta)
        print("recorded:", recorded)
        results = check.mark_recorded(results, recorded)
        check.write_report(results, device, path, meta=meta)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        shutil.copy(path, args.out_dir)
        shutil.copytree(args.work_dir, os.path.join(args.out_dir, "gpu_check_runs"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.jsonl"))
    code, counts = check.verdict(results)
    print(json.dumps({"report": path, "ok": sum(r["ok"] for r in results), "rows": len(results), "status": counts,
                      "exit": code}))
    return code


if __name__ == "__main__":
    sys.exit(main())
