"""Kernel profiles: a `jax.profiler` trace of a call, summarised as the top GPU kernels by time and their
totals by kind (GEMM, attention, copies, collectives, other fusions)."""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import time

from jaxrl_llm.bench.harness import emit

KINDS = (  # first match wins (cuDNN's attention kernels also say wgmma); XLA's / cuBLAS's / cuDNN's names
    ("attention", ("fmha", "flash", "sdpa", "cudnn", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "wgmma", "triton_gemm", "dot")),
    ("copy / transpose", ("copy", "transpose", "memcpy", "memset")),
    ("reduce / collective", ("reduce", "all-gather", "nccl")),
)


def summarize_trace(trace_dir: str, top: int = 30, section: str = "profile") -> list[dict]:
    """Top GPU kernels by time in the perfetto trace under `trace_dir`; emits and returns their rows."""
    files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    with gzip.open(files[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
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
         span_ms=(span[1] - span[0]) / 1e3, kernels=sum(count.values()))
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


def profile(fn, label: str, top: int):
    """Traces `fn()`; emits its top `top` kernels and their totals by kind (section `<label>_by_kind`)."""
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
