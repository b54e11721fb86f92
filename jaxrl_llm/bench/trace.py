"""Kernel profiles: a `jax.profiler` trace of a call, summarised as the top GPU kernels by time and their
totals by kind (GEMM, attention, copies, collectives, other fusions), and sorted into where a device's time
goes (`sort_trace`): matmul, attention, collectives exposed and overlapped, elementwise and norms, the
optimizer, and the gaps where the device runs nothing."""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import time
from collections import defaultdict

from jaxrl_llm.bench.harness import emit

KINDS = (  # first match wins (cuDNN's attention kernels also say wgmma); XLA's / cuBLAS's / cuDNN's names
    ("attention", ("fmha", "flash", "sdpa", "cudnn", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "wgmma", "triton_gemm", "dot")),
    ("copy / transpose", ("copy", "transpose", "memcpy", "memset")),
    ("reduce / collective", ("reduce", "all-gather", "nccl")),
)


def load_trace(trace_dir: str) -> list[dict]:
    """The events of the perfetto trace `jax.profiler` wrote under `trace_dir`."""
    files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no *perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(max(files, key=os.path.getmtime)) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def summarize_trace(trace_dir: str, top: int = 30, section: str = "profile") -> list[dict]:
    """Top GPU kernels by time in the perfetto trace under `trace_dir`; emits and returns their rows."""
    events = load_trace(trace_dir)
    # GPU kernel events live on device "processes"; find them by pid names.
    pids = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, n in pids.items() if "GPU" in n or "gpu" in n or "/device:" in n}
    totals: dict[str, float] = {}
    count: dict[str, int] = {}
    span = [1e30, 0.0]
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            name = e["name"][:90]
            totals[name] = totals.get(name, 0.0) + e.get("dur", 0.0)
            count[name] = count.get(name, 0) + 1
            span[0] = min(span[0], e["ts"])
            span[1] = max(span[1], e["ts"] + e.get("dur", 0.0))
    busy = sum(totals.values())
    emit(section=section, gpu_pids=[pids[p] for p in gpu_pids], kernel_busy_ms=busy / 1e3,
         span_ms=max(0.0, span[1] - span[0]) / 1e3, kernels=sum(count.values()))
    rows = [dict(section=section + "_kernel", name=name, total_ms=tot / 1e3, calls=count[name], share=tot / busy)
            for name, tot in sorted(totals.items(), key=lambda kv: -kv[1])[:top]]
    for row in rows:
        emit(**row)
    return rows


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other fusions"


# What a device's time is spent on (`sort_trace`), first match wins: the optimizer by its program (the jitted
# AdamW step of trainer/steps.py, `apply`), then by the kernel's or HLO op's name.
CATEGORIES = (
    ("collectives", ("all-gather", "all_gather", "allgather", "reduce-scatter", "reduce_scatter", "reducescatter",
                     "all-reduce", "all_reduce", "allreduce", "collective-permute", "all-to-all", "nccl")),
    ("attention", ("fmha", "flash", "sdpa", "cudnn", "attn", "attention")),
    ("matmul", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "wgmma", "dot", "ynn_fusion")),
)
OPTIMIZER_MODULES = ("jit_apply",)


def category(name: str, hlo_op: str = "", hlo_module: str = "") -> str:
    """One of 'optimizer', 'collectives', 'attention', 'matmul', 'elementwise' (fusions, norms, copies) for a
    device event: a GPU kernel (its name, and the HLO op and module XLA annotates it with) or an XLA:CPU op."""
    if hlo_module.startswith(OPTIMIZER_MODULES):
        return "optimizer"
    low = f"{name} {hlo_op}".lower()
    for kind, keys in CATEGORIES:
        if any(k in low for k in keys):
            return kind
    return "elementwise"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(a: tuple[float, float], union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in union)


def device_events(events: list[dict]) -> dict[str, list[dict]]:
    """The events that ran on each device: GPU kernels (on the trace's '/device:GPU:N' processes) or, in a trace
    without a GPU, XLA:CPU's ops (events whose args name the device ordinal and the HLO op)."""
    pids = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpus = {p for p, n in pids.items() if "/device:gpu" in n.lower()}
    out: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("dur") is None:
            continue
        if gpus:
            if e.get("pid") in gpus:
                out[pids[e["pid"]]].append(e)
        elif "hlo_op" in e.get("args", {}) and "device_ordinal" in e["args"]:
            out[f"cpu:{e['args']['device_ordinal']}"].append(e)
    return dict(out)


def sort_trace(events: list[dict]) -> dict[str, float]:
    """Milliseconds a device (the mean over the devices) spends in each category from its first event to its
    last (`span_ms`): `busy_ms` of each category (concurrent kernels count each), the collectives split into
    `collectives_exposed_ms` (no other kernel runs on the device meanwhile) and `collectives_overlapped_ms`,
    and `gaps_ms`, the span's time with no kernel at all (the host's launches, waits and syncs)."""
    per_device = []
    for evs in device_events(events).values():
        busy: dict[str, float] = defaultdict(float)
        spans, compute, collective = [], [], []
        for e in evs:
            args = e.get("args", {})
            kind = category(e["name"], str(args.get("hlo_op", "")), str(args.get("hlo_module", "")))
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            busy[kind] += span[1] - span[0]
            spans.append(span)
            (collective if kind == "collectives" else compute).append(span)
        union, compute_union = _union(spans), _union(compute)
        overlapped = sum(_overlap(c, compute_union) for c in collective)
        row = {f"{k}_ms": v / 1e3 for k, v in busy.items()}
        row["collectives_overlapped_ms"] = overlapped / 1e3
        row["collectives_exposed_ms"] = (busy["collectives"] - overlapped) / 1e3
        row["span_ms"] = (union[-1][1] - union[0][0]) / 1e3
        row["gaps_ms"] = row["span_ms"] - sum(b - a for a, b in union) / 1e3
        per_device.append(row)
    if not per_device:
        return {}
    keys = ["span_ms", "gaps_ms"] + [f"{k}_ms" for k in ("matmul", "attention", "collectives", "elementwise",
                                                          "optimizer")] + ["collectives_exposed_ms",
                                                                           "collectives_overlapped_ms"]
    return {k: sum(r.get(k, 0.0) for r in per_device) / len(per_device) for k in keys} | {"devices": len(per_device)}


def profile(fn, label: str, top: int):
    """Traces `fn()`; emits its top `top` kernels, their totals by kind (section `<label>_by_kind`) and where
    a device's time goes (section `<label>_sorted`, `sort_trace`)."""
    import jax

    trace_dir = os.path.join("/tmp", f"trace_{label}")
    shutil.rmtree(trace_dir, ignore_errors=True)  # an earlier run's trace would be read instead
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    kernels = summarize_trace(trace_dir, top=top, section=label)
    by_kind: dict[str, float] = {}
    for r in kernels:
        by_kind[kind_of(r["name"])] = by_kind.get(kind_of(r["name"]), 0.0) + r["total_ms"]
    emit(section=f"{label}_by_kind", wall_s=wall, top=top, **{k: round(v, 1) for k, v in by_kind.items()})
    sorted_ms = sort_trace(load_trace(trace_dir))
    emit(section=f"{label}_sorted", wall_s=wall, **{k: round(v, 2) for k, v in sorted_ms.items()})
