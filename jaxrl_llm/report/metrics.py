"""Reading a run's metrics.jsonl into one record per step, tolerant of killed and resumed runs."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter

import numpy as np

log = logging.getLogger(__name__)

# wait_prev_gen (an async trainer's wait for rollouts) and sync (its weight sync) are phases of its step too.
PHASES = ("wait_prev_gen", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_actor", "update_critic",
          "reshard", "sync")
# timing_s/* keys that are not phases of a train step: totals, occasional extras, and an async run's rollout side
# waiting for weights or queue room (on its own devices, beside the trainer's step).
TIMING_TOTALS = ("step", "step_total", "testing", "save_checkpoint", "rollout_wait")
# An asynchronous run's metrics (issue 30; veRL's fully_async names where it has them), by what they measure.
ASYNC_STALENESS = ("fully_async/staleness/mean", "fully_async/staleness/max")
ASYNC_COUNTS = ("fully_async/count/stale_samples_processed", "fully_async/count/stale_samples_dropped",
                "fully_async/partial/total_partial_num")
ASYNC_SHARES = ("fully_async/partial/partial_ratio", "rollouter/idle_ratio", "trainer/idle_ratio")
ASYNC_WAITS = ("timing_s/wait_prev_gen", "timing_s/rollout_wait", "timing_s/sync")
ASYNC_KEYS = (ASYNC_STALENESS + ASYNC_COUNTS + ASYNC_SHARES + ASYNC_WAITS
              + ("fully_async/version", "fully_async/queue_size"))
VAL_KEY = re.compile(r"^val-core/(?P<source>[^/]+)/(?P<metric>.+/mean@\d+)$")


class ReportError(Exception):
    """Bad input to the report; the message says what is wrong, where, and how to fix it."""


def metrics_path(run_dir: str) -> str:
    """RUN_DIR/metrics.jsonl; a path to the .jsonl file itself is accepted too."""
    if os.path.isdir(run_dir):
        return os.path.join(run_dir, "metrics.jsonl")
    if run_dir.endswith(".jsonl") and os.path.isfile(run_dir):
        return run_dir
    raise ReportError(f"{run_dir}: no such run directory; pass the train.run_dir that holds metrics.jsonl")


def _as_record(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    ok = isinstance(rec, dict) and isinstance(rec.get("step"), int) and not isinstance(rec["step"], bool)
    return rec if ok else None


def _as_number(v):
    """Non-finite floats are logged as the strings "nan"/"inf"/"-inf" (JSON has no such numbers)."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def read_metrics(path: str) -> tuple[list[dict], list[str]]:
    """One merged record per step, sorted by step, and notes on what was skipped or dropped.

    Lines of one step merge (validation may be logged on a line of its own). A step lower than one
    already read means the run was resumed from a checkpoint: the earlier attempt's later steps are
    dropped, since the resumed run logs them again. A line cut short by a killed run is skipped; when a
    resumed run appended its first record to that partial line, the appended record is kept.
    """
    if not os.path.isfile(path):
        raise ReportError(f"{path}: no such file; pass the run dir of a run that logged to jsonl "
                          "(train.logger includes 'jsonl')")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ReportError(f"{path}: cannot read it ({e.strerror or e}); check its permissions") from e
    by_step: dict[int, dict] = {}
    notes: list[str] = []
    top = None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec = _as_record(line)
        if rec is None:
            start = line.rfind('{"step"')
            rec = _as_record(line[start:]) if start > 0 else None
            kept = "; kept the record appended after it" if rec else ""
            notes.append(f"metrics.jsonl:{lineno}: partial or invalid line skipped (run killed mid-write?){kept}")
            if rec is None:
                continue
        step = rec.pop("step")
        if top is not None and step < top:
            dropped = [s for s in by_step if s > step]
            for s in dropped:
                del by_step[s]
            notes.append(f"metrics.jsonl:{lineno}: step {step} after step {top}: run resumed, so the "
                         f"{len(dropped)} later step(s) of the earlier attempt were dropped")
        top = step
        by_step.setdefault(step, {}).update({k: _as_number(v) for k, v in rec.items()})
    if not by_step:
        raise ReportError(f"{path}: no valid lines; expected one JSON object per line, like "
                          '{"step": 1, "critic/score/mean": 0.5}')
    return [{"step": s, **by_step[s]} for s in sorted(by_step)], notes


def load_metrics(run_dir: str) -> list[dict]:
    """The run's metrics, one dict per step (`{"step": int, key: value, ...}`) sorted by step.

    Lines of the same step are merged, non-finite values logged as strings ("nan", "inf") become
    floats, and a truncated line from a killed run is skipped with a warning. Raises ReportError when
    the file is missing or holds no valid line.
    """
    records, notes = read_metrics(metrics_path(run_dir))
    for note in notes:
        log.warning(note)
    return records


def is_num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class RunMetrics:
    """Column access to the merged records: a metric's steps and values where it was logged."""

    def __init__(self, records: list[dict]):
        self.records = records
        self.keys = {k for r in records for k in r if k != "step" and is_num(r[k])}
        # Training steps are the records with anything besides validation (a val-only line at step 0).
        self.train = [r for r in records if any(not k.startswith("val-") and k not in ("step", "timing_s/testing")
                                                for k in r)]

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """([S] steps, [S] float values) where `key` was logged; non-finite values become NaN (plot gaps)."""
        pts = [(r["step"], float(r[key])) for r in self.records if is_num(r.get(key))]
        steps, vals = (np.array(c) for c in zip(*pts)) if pts else (np.zeros(0, int), np.zeros(0))
        return steps, np.where(np.isfinite(vals), vals, np.nan)

    def has(self, key: str) -> bool:
        """Whether `key` has at least one finite value."""
        return key in self.keys and bool(np.isfinite(self.series(key)[1]).any())

    def table(self, keys: list[str], fill: float) -> tuple[np.ndarray, np.ndarray]:
        """([S] steps, [len(keys), S] values) over the records that log any of `keys`; gaps get `fill`."""
        rows = [r for r in self.records if any(is_num(r.get(k)) for k in keys)]
        vals = np.array([[float(r[k]) if is_num(r.get(k)) else fill for r in rows] for k in keys])
        return np.array([r["step"] for r in rows]), np.where(np.isfinite(vals), vals, fill)

    def val_keys(self) -> dict[str, str]:
        """Per-data-source validation keys with labels ("gsm8k", or "gsm8k acc/mean@4" when a source logs
        several), plus val-core/mean when there are several sources."""
        found = sorted(k for k in self.keys if VAL_KEY.match(k) and self.has(k))
        per_source = Counter(VAL_KEY.match(k)["source"] for k in found)
        out = {k: m["source"] if per_source[m["source"]] == 1 else f"{m['source']} {m['metric']}"
               for k in found if (m := VAL_KEY.match(k))}
        if len(out) > 1 and self.has("val-core/mean"):
            out["val-core/mean"] = "mean"
        return out

    def phases(self) -> list[str]:
        """Phase names of the timing_s/* keys, in the order a step runs them (unknown ones last)."""
        found = {k[len("timing_s/"):] for k in self.keys if k.startswith("timing_s/")} - set(TIMING_TOTALS)
        return sorted(found, key=lambda p: (PHASES.index(p) if p in PHASES else len(PHASES), p))

    def nonfinite(self) -> Counter:
        """How many non-finite values each key has."""
        return Counter(k for r in self.records for k, v in r.items() if is_num(v) and not np.isfinite(v))
