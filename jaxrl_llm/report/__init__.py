"""Run report: PNG plots of a run's metrics.jsonl curves and a short markdown summary.

`python -m jaxrl_llm.report RUN_DIR [--out DIR]` writes RUN_DIR/report/: overview.png (every panel),
one PNG per panel (reward with validation, validation per data source, KL, entropy, response length,
clip fraction, throughput/MFU, time per phase, grad norm/lr, value loss; for an asynchronous run staleness,
idle devices and waits) and summary.md, so a run can be judged at a glance rather than by reading jsonl.
Metric names are veRL's, as trainer/loggers.py writes them; panels whose metrics the run does not log are
skipped and listed in the summary (the async ones only drawn, never listed).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxrl_llm.report.metrics import ReportError, RunMetrics, load_metrics, metrics_path, read_metrics
from jaxrl_llm.report.plots import write_plots
from jaxrl_llm.report.summary import compute_stats, render_summary

__all__ = ["LAST_N", "ReportError", "load_metrics", "main", "write_report"]

log = logging.getLogger(__name__)

LAST_N = 20  # throughput and MFU in the summary are means over the last N training steps


def write_report(run_dir: str, out_dir: str | None = None, *, last_n: int = LAST_N) -> dict:
    """Write the plots and summary.md of the run in `run_dir` into `out_dir` (default RUN_DIR/report).

    Returns the key numbers (see compute_stats: reward first/last/best, validation last/best per data
    source, final_kl, step_time with phase percentages, last_n throughput/mfu, skipped_steps) plus
    "summary" (the summary.md path), "plots" ({panel: PNG path}), "skipped_panels" ({panel: reason})
    and "notes" (lines of metrics.jsonl that were skipped or dropped). Raises ReportError on bad input.
    """
    if last_n < 1:
        raise ReportError(f"last_n={last_n}: must be at least 1 (the number of final steps to average)")
    path = metrics_path(run_dir)
    records, notes = read_metrics(path)
    for note in notes:
        log.warning(note)
    run = RunMetrics(records)
    out_dir = out_dir or os.path.join(os.path.dirname(path), "report")
    try:
        os.makedirs(out_dir, exist_ok=True)
        plots, skipped = write_plots(run, out_dir)
        stats = compute_stats(run, last_n)
        summary = os.path.join(out_dir, "summary.md")
        with open(summary, "w", encoding="utf-8") as f:
            f.write(render_summary(os.path.dirname(path), stats, plots, skipped, notes, out_dir))
    except OSError as e:
        raise ReportError(f"{out_dir}: cannot write the report ({e.strerror or e}); pass --out DIR "
                          "somewhere writable") from e
    return {"summary": summary, "plots": plots, "skipped_panels": skipped, "notes": notes, **stats}


def main(argv: list[str] | None = None) -> int:
    """CLI: print the summary path; on bad input one `error: ...` line on stderr and exit status 2."""
    parser = argparse.ArgumentParser(prog="python -m jaxrl_llm.report",
                                     description="Plots and a markdown summary of a run's metrics.jsonl.")
    parser.add_argument("run_dir", help="the run directory (train.run_dir) holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="where to write the report (default RUN_DIR/report)")
    parser.add_argument("--last-n", type=int, default=LAST_N,
                        help=f"average throughput and MFU over the last N training steps (default {LAST_N})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s", stream=sys.stderr)
    try:
        result = write_report(args.run_dir, args.out, last_n=args.last_n)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result["summary"])
    return 0
