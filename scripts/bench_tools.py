"""Tool-side costs of agentic rollouts: ToolRunner throughput and the sandbox's start-up time.

    PYTHONPATH=. python scripts/bench_tools.py [--sessions 1024] [--sandbox_runs 10]

1. ToolRunner: `--sessions` trajectories each make one call in the same turn (as one rollout step's
   tool turn does), for a sync tool (the worker pool) and an async one (the event loop); calls per
   second and the wall time of the whole turn.
2. Sandbox: `run_python("print(1)")` end to end (launcher, namespaces, interpreter start, cleanup);
   median and max seconds, and the isolation the OS gave.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from jaxrl_llm.agent.builtin_tools import multiply
from jaxrl_llm.agent.sandbox import SandboxLimits, run_python
from jaxrl_llm.agent.tools import ToolCall, ToolRunner


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
            print(f"runner  {tool.__name__:15s} {sessions} calls in one turn: {seconds:.3f} s "
                  f"({sessions / seconds:,.0f} calls/s, max_workers={max_workers})")


def bench_sandbox(runs: int) -> None:
    times = []
    for _ in range(runs + 1):
        result = run_python("print(1)", limits=SandboxLimits(timeout_s=30.0))
        assert result.ok and result.stdout == "1\n", result.text()
        times.append(result.seconds)
    times = times[1:]  # the first pays for the one-off checks (can `nobody` run it, a pids cgroup)
    print(f"sandbox run_python('print(1)') x{runs}: median {statistics.median(times):.3f} s, max {max(times):.3f} s;"
          f" network_isolated={result.network_isolated} pid_namespace={result.pid_namespace}"
          f" note={result.isolation_note or '-'!r} ({sys.executable})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1024)
    parser.add_argument("--max_workers", type=int, default=32)
    parser.add_argument("--sandbox_runs", type=int, default=10)
    args = parser.parse_args(argv)
    bench_runner(args.sessions, args.max_workers)
    bench_sandbox(args.sandbox_runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
