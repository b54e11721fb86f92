"""Runs tool calls: concurrently, with a timeout each, and never raising for a tool's fault.

One `ToolRunner` holds the tools and an asyncio event loop on its own thread. Async tool methods run on
that loop; sync ones run on a pool of `max_workers` daemon threads, awaited from the loop. A `ToolSession` (one per
trajectory) creates a tool's instance on its first call (veRL's `create(**create_kwargs)`), runs a
turn's calls together, sums `calc_reward` over the tools it used, and releases them.

Timeouts: an async tool is cancelled at its timeout. A sync Python function cannot be killed: one that
hangs keeps its (daemon) thread until it returns; the pool starts a replacement so that it keeps
`max_workers` free threads, and `ToolRunner.stuck_threads` counts the hung ones. Daemon threads never
block the interpreter's exit (a `ThreadPoolExecutor`'s threads would). For untrusted or
possibly-hanging code use the sandboxed `python` tool (`jaxrl_llm.agent.sandbox`), which runs in a
separate process group that is killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_llm.agent.tool_types import (
    ERROR_KINDS,
    TRUNCATE_SIDES,
    BaseTool,
    ToolCall,
    ToolCallError,
    ToolResult,
    check_call_arguments,
    function_tool,
    truncate_text,
    unpack_execute,
)

logger = logging.getLogger(__name__)

# The keys of a row's `extra_info.tools_kwargs[tool_name]` (veRL), each a dict of keyword arguments.
TOOLS_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


class _Job:
    """One sync tool-method call for the pool. `abandon()` (the caller timed out) skips it if it is still
    queued; if it is running, its worker is stuck, so the pool starts a replacement and the stuck worker
    retires when the call returns."""

    def __init__(self, fn: Callable[[], Any], settle: Callable[[Any, BaseException | None], None]):
        self.fn, self.settle = fn, settle
        self.lock = threading.Lock()
        self.state = "queued"  # -> "running" -> "done"
        self.abandoned = False

    def abandon(self) -> bool:
        """Marks the job abandoned; True if a worker is stuck in it."""
        with self.lock:
            self.abandoned = True
            return self.state == "running"


class _DaemonPool:
    """`size` daemon worker threads for sync tool methods (daemon: a hung tool never blocks the exit)."""

    def __init__(self, size: int, name: str, runner: ToolRunner):
        self.name, self.runner = name, runner
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(size):
            self.spawn()

    def spawn(self) -> None:
        threading.Thread(target=self._work, name=self.name, daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            with job.lock:
                if job.abandoned:
                    continue
                job.state = "running"
            result = error = None
            try:
                result = job.fn()
            except BaseException as e:  # a tool's fault is reported, never raised here
                error = e
            with job.lock:
                job.state = "done"
                stuck = job.abandoned
            if stuck:  # a replacement took this thread's place while it hung
                with self.runner._lock:
                    self.runner.stuck_threads -= 1
                return
            job.settle(result, error)

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)

    def shutdown(self, size: int) -> None:
        for _ in range(size):
            self._jobs.put(None)


class ToolRunner:
    """The tools of a run and the machinery that calls them.

    Args:
      tools: `BaseTool`s or typed Python functions (wrapped with `function_tool`).
      max_parallel_calls: calls run per assistant turn (`rollout.multi_turn.max_parallel_calls`); the
        rest get error 'too_many_calls'.
      timeout_s: seconds each call may take, `create` included.
      max_tool_response_length: characters of a tool response the model sees
        (`rollout.multi_turn.max_tool_response_length`).
      tool_response_truncate_side: "left", "right" or "middle" (the part kept, as veRL).
      max_workers: threads for sync tool methods, shared by all sessions (async tools need none).
    """

    def __init__(self, tools: Sequence[BaseTool | Callable], *, max_parallel_calls: int = 1,
                 timeout_s: float = 30.0, max_tool_response_length: int = 256,
                 tool_response_truncate_side: str = "middle", max_workers: int = 32):
        if not isinstance(max_parallel_calls, int) or max_parallel_calls < 1:
            raise ValueError(f"rollout.multi_turn.max_parallel_calls={max_parallel_calls!r}: use an int >= 1")
        if not isinstance(max_tool_response_length, int) or max_tool_response_length < 1:
            raise ValueError(f"rollout.multi_turn.max_tool_response_length={max_tool_response_length!r}: "
                             "use an int >= 1 (characters)")
        if tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"rollout.multi_turn.tool_response_truncate_side="
                             f"{tool_response_truncate_side!r}: use one of {TRUNCATE_SIDES}")
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"tool timeout_s={timeout_s!r}: use a positive number of seconds")
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"ToolRunner max_workers={max_workers!r}: use an int >= 1")
        self.tools: dict[str, BaseTool] = {}
        for tool in tools:
            tool = function_tool(tool)
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}; tool names must be unique")
            self.tools[tool.name] = tool
        self.max_parallel_calls = max_parallel_calls
        self.timeout_s = float(timeout_s)
        self.max_tool_response_length = max_tool_response_length
        self.tool_response_truncate_side = tool_response_truncate_side
        # Plain dicts, for tokenizer.apply_chat_template(..., tools=schemas).
        self.schemas: list[dict] = [t.tool_schema.model_dump() for t in self.tools.values()]
        self.stuck_threads = 0
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._pool = _DaemonPool(max_workers, name=f"tool-worker-{id(self):x}", runner=self)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tool-runner-loop", daemon=True)
        self._thread.start()
        self._closed = False

    def open(self, tools_kwargs: dict | None = None) -> ToolSession:
        """A session for one trajectory; `tools_kwargs` is the row's `extra_info.tools_kwargs`."""
        if self._closed:
            raise RuntimeError("ToolRunner.open: the runner is closed")
        return ToolSession(self, tools_kwargs)

    def close(self) -> None:
        """Cancels calls in flight (their futures raise CancelledError) and stops the event loop thread.
        Sync tools still running keep their daemon threads until they return."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(self.max_workers)
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout=5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ToolRunner(tools={list(self.tools)}, max_parallel_calls={self.max_parallel_calls})"

    def submit(self, coro) -> concurrent.futures.Future:
        """Runs a coroutine on the runner's loop; a thread-safe future of its result."""
        if self._closed:
            coro.close()
            raise RuntimeError("ToolRunner: the runner is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def invoke(self, fn: Callable, *args, **kwargs) -> Any:
        """Calls a tool method: awaited if async, inline if it is `BaseTool`'s own trivial default, else on
        the worker pool (awaited here)."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        if getattr(fn, "__func__", None) in _INLINE_DEFAULTS:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # RuntimeError: the runner was closed meanwhile
                loop.call_soon_threadsafe(_settle, future, result, error)

        job = _Job(functools.partial(fn, *args, **kwargs), settle)
        self._pool.submit(job)
        try:
            result = await future
        except asyncio.CancelledError:  # the caller timed out
            if job.abandon():
                with self._lock:
                    self.stuck_threads += 1
                self._pool.spawn()
            raise
        if inspect.isawaitable(result):
            result = await result
        return result


async def _with_timeout(coro, seconds: float) -> Any:
    """`asyncio.wait_for` without its extra task where Python has `asyncio.timeout` (3.11+)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await coro
    return await asyncio.wait_for(coro, seconds)


# BaseTool's default create / calc_reward / release do no work: a thread hop for them would cost more.
_INLINE_DEFAULTS = (BaseTool.create, BaseTool.calc_reward, BaseTool.release)


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ToolSession:
    """The tools of one trajectory. Create it with `ToolRunner.open(tools_kwargs)`.

    `metrics` counts `calls`, `errors`, `errors/<kind>` for each of `ERROR_KINDS`, `seconds` (the
    summed time of the calls) and `errors/reward` (calc_reward failures, not in `errors`).
    """

    def __init__(self, runner: ToolRunner, tools_kwargs: dict | None):
        self.runner = runner
        self.tools_kwargs = _check_tools_kwargs(tools_kwargs, runner.tools)
        self.id = uuid.uuid4().hex
        self.metrics: dict[str, float] = {"calls": 0.0, "errors": 0.0, "seconds": 0.0,
                                          **{f"errors/{k}": 0.0 for k in ERROR_KINDS}, "errors/reward": 0.0}
        self._instances: dict[str, asyncio.Future] = {}  # tool name -> its instance id (on the loop)
        self._released = False

    def call(self, calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        """Runs one assistant turn's calls concurrently; one `ToolResult` per call, in order."""
        return self.call_future(calls).result()

    def call_future(self, calls: Sequence[ToolCall | ToolCallError]) -> concurrent.futures.Future:
        """Like `call`, but returns at once: a future of the results (for loops that interleave rows)."""
        if self._released:
            raise RuntimeError("ToolSession.call after release()")
        return self.runner.submit(self._call_all(list(calls)))

    def reward(self) -> float:
        """The sum of `calc_reward` over the tools this trajectory used (veRL semantics). A tool whose
        calc_reward raises or times out adds 0 and counts in `metrics["errors/reward"]`."""
        return self.runner.submit(self._reward()).result()

    def release(self) -> None:
        """Releases every tool instance this trajectory created; safe to call twice."""
        if not self._released:
            self._released = True
            self.runner.submit(self._release()).result()

    def __enter__(self) -> ToolSession:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    async def _call_all(self, calls: list) -> list[ToolResult]:
        results = await asyncio.gather(*(self._call_one(c, i) for i, c in enumerate(calls)))
        for result in results:  # metrics change only here, on the loop thread
            self.metrics["calls"] += 1
            self.metrics["seconds"] += result.seconds
            if result.error:
                self.metrics["errors"] += 1
                self.metrics[f"errors/{result.error}"] += 1
        return list(results)

    async def _call_one(self, call: ToolCall | ToolCallError, index: int) -> ToolResult:
        start = time.perf_counter()
        text, reward, error = await self._run_call(call, index)
        text = truncate_text(text, self.runner.max_tool_response_length, self.runner.tool_response_truncate_side)
        return ToolResult(text=text, reward=reward, error=error, seconds=time.perf_counter() - start)

    async def _run_call(self, call: ToolCall | ToolCallError, index: int) -> tuple[str, float, str | None]:
        runner = self.runner
        if index >= runner.max_parallel_calls:
            return (f"Error: too many tool calls in one turn; at most {runner.max_parallel_calls} run, "
                    "make the others in a later turn", 0.0, "too_many_calls")
        if isinstance(call, ToolCallError):
            return f"Error: {call.message}", 0.0, "parse"
        tool = runner.tools.get(call.name)
        if tool is None:
            return (f"Error: unknown tool {call.name!r}; the available tools are {sorted(runner.tools)}",
                    0.0, "unknown_tool")
        arguments, problem = check_call_arguments(tool, call.arguments)
        if problem:
            return f"Error: {problem}", 0.0, "bad_arguments"
        try:
            return (*await _with_timeout(self._execute(tool, arguments), runner.timeout_s), None)
        except TimeoutError:
            return f"Error: tool {tool.name!r} timed out after {runner.timeout_s:g} s", 0.0, "timeout"
        except Exception as e:  # the tool's own fault: the model sees it, the run goes on
            logger.debug("tool %r raised", tool.name, exc_info=True)
            return f"Error: tool {tool.name!r} raised {type(e).__name__}: {e}", 0.0, "raised"

    async def _execute(self, tool: BaseTool, arguments: dict) -> tuple[str, float]:
        created = self._instance(tool)
        instance_id = created.result() if created.done() else await asyncio.shield(created)
        kwargs = self._kwargs(tool.name, "execute_kwargs")
        return unpack_execute(await self.runner.invoke(tool.execute, instance_id, arguments, **kwargs))

    def _instance(self, tool: BaseTool) -> asyncio.Future:
        if tool.name not in self._instances:
            self._instances[tool.name] = asyncio.ensure_future(self._create(tool))
        return self._instances[tool.name]

    async def _create(self, tool: BaseTool) -> str:
        create_kwargs = self._kwargs(tool.name, "create_kwargs")
        wanted = f"{self.id}-{tool.name}"
        kwargs = dict(create_kwargs)
        # veRL's agent loop passes create_kwargs=..., its older rollout passes them as keywords: a tool
        # written for either reads its arguments when it takes **kwargs.
        if "create_kwargs" not in kwargs and _takes_var_kwargs(tool.create):
            kwargs["create_kwargs"] = dict(create_kwargs)
        out = await self.runner.invoke(tool.create, wanted, **kwargs)
        instance_id = out[0] if isinstance(out, tuple) and out else out
        return instance_id if instance_id is not None else wanted

    def _kwargs(self, name: str, key: str) -> dict:
        return dict((self.tools_kwargs.get(name) or {}).get(key) or {})

    async def _created(self) -> list[tuple[BaseTool, str]]:
        created = []
        for name, future in self._instances.items():
            try:
                created.append((self.runner.tools[name], await asyncio.wait_for(asyncio.shield(future), 0.01)))
            except Exception:  # create failed or never finished: nothing to score or release
                continue
        return created

    async def _reward(self) -> float:
        total = 0.0
        for tool, instance_id in await self._created():
            kwargs = self._kwargs(tool.name, "calc_reward_kwargs")
            try:
                value = await asyncio.wait_for(self.runner.invoke(tool.calc_reward, instance_id, **kwargs),
                                               self.runner.timeout_s)
                total += float(value or 0.0)  # None (a stub calc_reward) adds 0
            except Exception as e:
                self.metrics["errors/reward"] += 1
                logger.warning("tool %r: calc_reward failed (%s: %s); it adds 0", tool.name, type(e).__name__, e)
        return total

    async def _release(self) -> None:
        for tool, instance_id in await self._created():
            kwargs = self._kwargs(tool.name, "release_kwargs")
            try:
                await asyncio.wait_for(self.runner.invoke(tool.release, instance_id, **kwargs),
                                       self.runner.timeout_s)
            except Exception as e:
                logger.warning("tool %r: release failed (%s: %s)", tool.name, type(e).__name__, e)


@functools.lru_cache(maxsize=256)
def _takes_var_kwargs(method: Callable) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(method).parameters.values())


def _check_tools_kwargs(tools_kwargs: Any, tools: dict[str, BaseTool]) -> dict:
    """A row's `extra_info.tools_kwargs`, checked: {tool name: {create_kwargs: {...}, ...}}. Entries that
    are None (parquet fills absent struct fields with null) count as absent."""
    if tools_kwargs is None:
        return {}
    where = "extra_info.tools_kwargs"
    if not isinstance(tools_kwargs, dict):
        raise ValueError(f"{where} must be a dict {{tool name: {{'create_kwargs': {{...}}}}}}, got "
                         f"{type(tools_kwargs).__name__} {tools_kwargs!r:.200}")
    checked = {}
    for name, entry in tools_kwargs.items():
        if entry is None:
            continue
        if name not in tools:
            raise ValueError(f"{where} names tool {name!r}, which is not configured (tools: {sorted(tools)}); "
                             "check rollout.multi_turn.tool_config_path")
        if not isinstance(entry, dict):
            raise ValueError(f"{where}[{name!r}] must be a dict with keys {TOOLS_KWARGS_KEYS}, got {entry!r:.200}")
        for key, value in entry.items():
            if key not in TOOLS_KWARGS_KEYS:
                raise ValueError(f"{where}[{name!r}] has key {key!r}; use {TOOLS_KWARGS_KEYS}")
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{where}[{name!r}][{key!r}] must be a dict of keyword arguments, "
                                 f"got {value!r:.200}")
        checked[name] = entry
    return checked
