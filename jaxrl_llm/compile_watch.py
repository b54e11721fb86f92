"""Counts this process's XLA compiles (every jitted program: the trainer's steps and the engine's), from jax's
own backend-compile events, so a step that compiles shows it in the metrics (`perf/compiles`, `perf/compile_s`).

A persistent-cache hit or an engine program loaded from disk is no compile and is not counted.
"""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_totals = {"compiles": 0, "compile_s": 0.0}
_registered = False


def _on_duration(event: str, duration: float, **_) -> None:
    if event == _EVENT:
        with _lock:
            _totals["compiles"] += 1
            _totals["compile_s"] += duration


def start() -> None:
    """Starts counting (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def totals() -> dict[str, float]:
    """{"compiles": count, "compile_s": seconds} since `start`."""
    start()
    with _lock:
        return dict(_totals)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The step metrics between two `totals()`."""
    return {"perf/compiles": after["compiles"] - before["compiles"],
            "perf/compile_s": after["compile_s"] - before["compile_s"]}
