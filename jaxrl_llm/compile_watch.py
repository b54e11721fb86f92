"""Counts this process's XLA compiles (every jitted program: the trainer's steps and the engine's), from jax's
own events, so a step that compiles shows it in the metrics (`perf/compiles`, `perf/compile_s`).

jax records one backend-compile event for every program it builds, whether XLA compiled it or it came back from
the persistent compilation cache. A cache hit also records a cache-hit event, first and in the same thread, so
each thread remembers whether its next backend-compile event is a load: loads are counted apart
(`perf/cache_loads`, `perf/cache_load_s`), never as compiles. An engine program loaded from its own store
(`rollout/programs.py`) records neither.
"""

from __future__ import annotations

import threading

import jax

_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_local = threading.local()  # .hit: this thread's next backend-compile event is a persistent-cache load
_totals = {"compiles": 0, "compile_s": 0.0, "cache_loads": 0, "cache_load_s": 0.0}
_registered = False


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT:
        _local.hit = True


def _on_duration(event: str, duration: float, **_) -> None:
    if event != _COMPILE:
        return
    loaded = getattr(_local, "hit", False)
    _local.hit = False
    with _lock:
        if loaded:
            _totals["cache_loads"] += 1
            _totals["cache_load_s"] += duration
        else:
            _totals["compiles"] += 1
            _totals["compile_s"] += duration


def start() -> None:
    """Starts counting (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def totals() -> dict[str, float]:
    """{"compiles", "compile_s", "cache_loads", "cache_load_s"} since `start`: XLA compiles and persistent-cache
    loads, with their seconds."""
    start()
    with _lock:
        return dict(_totals)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The step metrics between two `totals()`."""
    return {f"perf/{k}": after[k] - before[k] for k in ("compiles", "compile_s", "cache_loads", "cache_load_s")}
