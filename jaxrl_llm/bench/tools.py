"""Tool-side costs of agentic rollouts: ToolRunner throughput and the sandbox's start-up time.

    python -m jaxrl_llm.bench --sections tools [--sessions 1024] [--sandbox_runs 10]

1. ToolRunner: `--sessions` trajectories each make one call in the same turn (as one rollout step's
   tool turn does), for a sync tool (the worker pool) and an async one (the event loop); calls per
   second and the wall time of the whole turn.
2. Sandbox: `run_python("print(1)")` end to end (launcher, namespaces, interpreter start, cleanup);
   median and max seconds, and the isolation the OS gave.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from jaxrl_llm.agent.builtin_tools import multiply
from jaxrl_llm.agent.sandbox import SandboxLimits, run_python
from jaxrl_llm.agent.tools import ToolCall, ToolRunner
from jaxrl_llm.bench.harness import emit, option, section

option("--sessions", type=int, default=1024, help="tools: trajectories calling in one turn")
option("--max_workers", type=int, default=32, help="tools: the runner's worker threads")
option("--sandbox_runs", type=int, default=10, help="tools: sandboxed runs timed")


async def async_multiply(a: int, b: int) -> int:
    """Multiplies two integers after yielding to the event loop once."""
    await asyncio.sleep(0)
    return a * b


def bench_runner(sessions: int, max_workers: int) -> None:
    for tool in (multiply, async_multiply):
        with ToolRunner([tool], timeout_s=60.0, max_workers=max_workers) as runner:
            for _trial in range(2):  # the first warms the pool and the loop
                opened = [runner.open() for _ in range(sessions)]
                start = time.perf_counter()
                futures = [s.call_future([ToolCall(tool.__name__, {"a": i, "b": 7})]) for i, s in enumerate(opened)]
                results = [f.result()[0] for f in futures]
                seconds = time.perf_counter() - start
                assert all(r.error is None for r in results)
                for s in opened:
                    s.release()
            emit(section="tools", what="runner", tool=tool.__name__, calls=sessions, seconds=seconds,
                 calls_per_s=sessions / seconds, max_workers=max_workers)


def bench_sandbox(runs: int) -> None:
    times = []
    for _ in range(runs + 1):
        result = run_python("print(1)", limits=SandboxLimits(timeout_s=30.0))
        assert result.ok and result.stdout == "1\n", result.text()
        times.append(result.seconds)
    times = times[1:]  # the first pays for the one-off checks (can `nobody` run it, a pids cgroup)
    emit(section="tools", what="sandbox run_python('print(1)')", runs=runs, median_s=statistics.median(times),
         max_s=max(times), network_isolated=result.network_isolated, pid_namespace=result.pid_namespace,
         note=result.isolation_note or "-", python=sys.executable)


@section("tools", help="tool-side costs of agentic rollouts: ToolRunner throughput, the sandbox's start-up")
def tools(args) -> None:
    bench_runner(args.sessions, args.max_workers)
    bench_sandbox(args.sandbox_runs)
