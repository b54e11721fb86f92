"""XLA's GPU options for overlapping FSDP's collectives with compute (`train.xla_gpu_overlap`), added to
XLA_FLAGS before the backend starts.

Under FSDP every layer of the scan all-gathers its weights before its matmuls (forward, and again for the
backward) and reduce-scatters its gradients after. By default XLA:GPU runs a collective where the program
puts it; these options let it start the next layer's gathers during this layer's compute. They are what
JAX-Toolbox's GPU performance guide and XLA's optimization level O1 enable (benchmarks/NOTES.md says what
each should do; the GPU session `benchmarks/sessions/mfu_issue40.sh` measures them):

  latency-hiding scheduler   schedules the asynchronous collectives against the compute by an estimate of both
  pipelined all-gather /     moves a loop iteration's collective into the previous iteration (the layer scan's
  reduce-scatter / all-reduce  gathers of layer i+1 run during layer i's matmuls)
  while-loop double buffering  unrolls the layer scan by two, which removes the barrier between iterations
  combine thresholds (1 GiB) lets the combiners merge a layer's collectives into one (the 7 kernels of a
                             Qwen2.5-7B layer are 0.93 GB in fp32), fewer and larger NCCL calls
  combine by dim off         combines collectives whatever their gather dimension
  highest-priority stream    runs the collectives' stream ahead of the compute stream's kernels

Only flags this XLA knows are listed (an unknown flag in XLA_FLAGS stops the process when the backend starts:
tests/test_xla_flags.py starts one with these). A flag the user already sets in XLA_FLAGS keeps the user's value.
"""

from __future__ import annotations

import importlib.util
import logging
import os

log = logging.getLogger(__name__)

COMBINE_BYTES = 1 << 30

GPU_OVERLAP_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
    "xla_gpu_all_gather_combine_threshold_bytes": str(COMBINE_BYTES),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(COMBINE_BYTES),
    "xla_gpu_all_reduce_combine_threshold_bytes": str(COMBINE_BYTES),
    "xla_gpu_enable_all_gather_combine_by_dim": "false",
    "xla_gpu_enable_reduce_scatter_combine_by_dim": "false",
    "xla_gpu_enable_highest_priority_async_stream": "true",
}


def flag_names(xla_flags: str) -> set[str]:
    """The names of the flags set in an XLA_FLAGS string ('--name=value' or '--name')."""
    return {tok[2:].split("=", 1)[0] for tok in xla_flags.split() if tok.startswith("--")}


def compose(xla_flags: str, flags: dict[str, str]) -> str:
    """`xla_flags` with `flags` appended, each as '--name=value', except those it sets already (the user's
    value stays); nothing twice."""
    taken = flag_names(xla_flags)
    added = [f"--{name}={value}" for name, value in flags.items() if name not in taken]
    return " ".join(xla_flags.split() + added)


def gpu_backend_expected() -> bool:
    """Whether jax will start a GPU backend: JAX_PLATFORMS names one, or (unset) a CUDA plugin is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() in ("cuda", "gpu", "rocm") for p in platforms.lower().split(","))
    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def apply_gpu_overlap(enabled: bool) -> bool:
    """Adds GPU_OVERLAP_FLAGS to XLA_FLAGS where `enabled`, a GPU backend is expected and none has started yet
    (XLA reads its flags once, when the backend starts); returns whether they were added."""
    if not enabled or not gpu_backend_expected():
        return False
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        log.warning("train.xla_gpu_overlap: the backend has started already; its XLA flags stay as they are")
        return False
    os.environ["XLA_FLAGS"] = compose(os.environ.get("XLA_FLAGS", ""), GPU_OVERLAP_FLAGS)
    log.info("train.xla_gpu_overlap: XLA_FLAGS=%s", os.environ["XLA_FLAGS"])
    return True
