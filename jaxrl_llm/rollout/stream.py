"""A rollout stream: the paged engine running continuously, for fully asynchronous training.

The trainer submits prompt groups while the engine runs (`submit`), and takes each group back the moment its `n`
responses are done (`on_group`), not when a whole batch is. New weights are staged on the rollout devices
(`stage_weights`) while the shards decode, and each shard takes them at its next decode boundary: a partial
rollout. The rows it is running then either keep their K/V, computed by the old weights (`kv='keep'`), or are
sent back to be prefilled again by the new ones (`kv='recompute'`, vLLM's recompute preemption). Every token
records the version of the weights that sampled it, so the trainer can weigh stale tokens and drop samples past
its staleness bound. `drain` waits for the rows in flight (a sync without partial rollouts), and `pause` parks
every shard at a boundary, so that a checkpoint can take the rows' tokens so far.

Rows of several submissions share segments: each row carries its own request's PRNG key, so row r of a
submission with seed s draws token t from fold_in(fold_in(key(s), stream_r), t), as a plain `generate` does.
One process (the stream drives this process's shards).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl_llm.rollout.base import RolloutError, SamplingParams
from jaxrl_llm.rollout.dealer import Dealer
from jaxrl_llm.rollout.engine_weights import row_budgets
from jaxrl_llm.rollout.jax_engine import JaxEngine, key_data, make_rows
from jaxrl_llm.rollout.rows import Row, RowStore


@dataclasses.dataclass
class GroupResult:
    """One prompt's `n` responses, handed back as soon as all of them are done."""

    meta: object  # what the submitter attached to the prompt
    prompt: np.ndarray  # [P] int32
    tokens: np.ndarray  # [n, T] int32, padded with pad_id
    logprobs: np.ndarray  # [n, T] float32, 0 on padding
    versions: np.ndarray  # [n, T] int32: the weights' version that sampled each token (0 on padding)
    lengths: np.ndarray  # [n] int32
    finish_reasons: list[str]

    @property
    def _sampled_versions(self) -> np.ndarray:
        """The versions of the tokens the rows hold (padding left out)."""
        return self.versions[np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]]

    @property
    def oldest_version(self) -> int:
        v = self._sampled_versions
        return int(v.min()) if v.size else 0

    @property
    def partial(self) -> bool:
        """Whether its tokens span more than one weight version (a partial rollout)."""
        v = self._sampled_versions
        return bool(v.size and v.max() != v.min())


@dataclasses.dataclass(eq=False)
class _Group:
    slot: int
    meta: object
    prompt: np.ndarray
    rows: list[Row]
    left: int


class ThreadFailure:
    """A background thread's exception, handed to the trainer's thread: the thread calls `fail`, the trainer
    `check`. The class using it sets `error` (None) and `_cond` (a Condition its waiters wait on)."""

    error: BaseException | None
    _cond: threading.Condition

    def fail(self, e: BaseException) -> None:
        self.error = e
        with self._cond:
            self._cond.notify_all()

    def check(self) -> None:
        """Raises the rollout thread's failure in the caller's thread."""
        if self.error is not None:
            raise RolloutError(f"the rollout stream failed: {type(self.error).__name__}: {self.error}") \
                from self.error


class RolloutStream(ThreadFailure):
    """The engine's shards running on a thread of their own until `close`.

    Args:
      engine: a JaxEngine on the rollout devices, with weights (version `engine.version`).
      sampling: every submission's sampling (its `n`, temperature, top-k/p, `max_new_tokens`; `seed` per submit).
      capacity: prompt groups in flight at most (queued or running); `submit` waits for room.
      on_group: called with each `GroupResult` from a shard's thread (keep it short: a queue's `put`).
      kv: what rows running at a weight swap do: "recompute" their K/V with the new weights, or "keep" it.
    """

    def __init__(self, engine: JaxEngine, sampling: SamplingParams, *, capacity: int,
                 on_group: Callable[[GroupResult], None], kv: str = "recompute"):
        if kv not in ("keep", "recompute"):
            raise ValueError(f"async_training.partial_rollout_kv = {kv!r}: use 'keep' or 'recompute'")
        if engine.params is None:
            raise RuntimeError("RolloutStream: the engine has no weights; call update_weights first")
        self.engine, self.sampling, self.n, self.kv = engine, sampling, sampling.n, kv
        self.on_group = on_group
        self.capacity = capacity
        self.store = RowStore(capacity * self.n, sampling.max_new_tokens, engine.pad_id)
        self.spec = engine.paged_spec([[0]], sampling, None)
        self._free = list(range(capacity - 1, -1, -1))
        self._groups: dict[int, _Group] = {}
        self._cond = threading.Condition()
        self._pending = None  # (engine params, version) staged, not yet taken by every shard
        self._took: set[int] = set()
        self._paused = self._parked = 0
        self._aborting = False
        self.swaps = self.recomputed = 0
        self._busy_s, self._busy_since = 0.0, None  # time with rows in flight (the rollout devices at work)
        longest = engine.max_model_len or (engine.max_prompt_length + sampling.max_new_tokens)
        engine.prepare(self.spec, capacity * self.n, longest - 1, 1, 1)
        self.dealer = Dealer([[] for _ in engine.shards], [s.index for s in engine.local_shards],
                             steal=engine._steal, open=True)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-stream", daemon=True)
        self._thread.start()

    # ---- the rollout thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine.run_shards(self.dealer, self.spec, hooks=self)
        except BaseException as e:  # noqa: BLE001 (handed to the trainer's thread by `check`)
            self.fail(e)

    # ---- shard hooks (called from the shards' threads) --------------------------------------------
    def at_boundary(self, shard, sched) -> None:
        if self._aborting:  # the run ends: drop what this shard holds
            sched.preempt_all()
            sched.waiting.clear()
            return
        with self._cond:
            while self._paused:  # a checkpoint reads the rows' tokens
                self._parked += 1
                self._cond.notify_all()
                self._cond.wait()
                self._parked -= 1
            pending = self._pending
            if pending is None or shard.index in self._took:
                return
            params, version = pending
            if self.kv == "recompute":
                self.recomputed += sched.preempt_all()
            shard.set_params(params, version)
            self._took.add(shard.index)
            if self._took >= {s.index for s in self.engine.local_shards}:  # every shard runs the new weights
                self.engine.params, self.engine.version = params, version
                self._pending = None
                self._took = set()
                self.swaps += 1
                self._cond.notify_all()

    def finished(self, rows: list[Row]) -> None:
        done = []
        with self._cond:
            for r in rows:
                g = self._groups[r.rid // self.n]
                g.left -= 1
                if g.left == 0:
                    done.append(g)
        for g in done:
            self.on_group(self._result(g))
            with self._cond:
                del self._groups[g.slot]
                self._free.append(g.slot)
                if not self._groups and self._busy_since is not None:
                    self._busy_s += time.perf_counter() - self._busy_since
                    self._busy_since = None
                self._cond.notify_all()

    def _result(self, g: _Group) -> GroupResult:
        rid = np.asarray([r.rid for r in g.rows])
        lengths = self.store.lengths[rid].copy()
        width = max(1, int(lengths.max()))
        mask = np.arange(width)[None, :] < lengths[:, None]
        tokens = np.where(mask, self.store.tokens[rid, :width], self.spec.pad_id).astype(np.int32)
        stops = np.asarray(self.spec.stop_ids, np.int32)
        last = tokens[np.arange(len(rid)), np.maximum(lengths - 1, 0)]
        return GroupResult(g.meta, g.prompt, tokens, np.where(mask, self.store.logps[rid, :width], 0.0),
                           np.where(mask, self.store.versions[rid, :width], 0).astype(np.int32), lengths,
                           np.where(np.isin(last, stops), "stop", "length").tolist())

    # ---- the trainer's side ----------------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], metas: Sequence[object], *, seed: int,
               streams: Sequence[int] | None = None, max_new_tokens_per_row: Sequence[int] | None = None,
               partial: dict | None = None) -> None:
        """Adds prompt groups (waiting for room). `streams` name each row's random stream (len(prompts) * n;
        default the row's index in this submission); `partial` resumes rows that already hold tokens
        ({"tokens", "logprobs", "versions": [rows, T], "lengths": [rows]}), prefilled again at admission."""
        n = self.n
        count = len(prompts) * n
        row_max = row_budgets(max_new_tokens_per_row, count, self.sampling.max_new_tokens)
        streams = np.arange(count) if streams is None else np.asarray(streams)
        self.engine._request_spec(prompts, self.sampling, row_max)  # one clear error before any work
        key = key_data(seed)
        for i, (p, meta) in enumerate(zip(prompts, metas)):
            with self._cond:
                while not self._free:
                    self.check()
                    self._cond.wait(0.5)
                slot = self._free.pop()
            rows = make_rows([p], n, row_max[i * n:(i + 1) * n], streams[i * n:(i + 1) * n], self.store, key,
                             self.spec, first=slot * n)
            self.store.lengths[slot * n:(slot + 1) * n] = 0
            if partial is not None:
                for j, r in enumerate(rows):
                    k = int(partial["lengths"][i * n + j])
                    for name, dst in (("tokens", self.store.tokens), ("logprobs", self.store.logps),
                                      ("versions", self.store.versions)):
                        dst[r.rid, :k] = partial[name][i * n + j, :k]
                    self.store.lengths[r.rid] = k
            g = _Group(slot, meta, np.asarray(p, np.int32), rows, left=n)
            with self._cond:
                if not self._groups:
                    self._busy_since = time.perf_counter()
                self._groups[slot] = g
            self.dealer.submit([rows])  # runs while the next waits for room

    def busy_seconds(self) -> float:
        """Seconds so far with rows in flight."""
        with self._cond:
            return self._busy_s + (time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0)

    def in_flight(self) -> int:
        with self._cond:
            return len(self._groups)

    def stage_weights(self, params, version: int) -> None:
        """Converts new trainer weights onto the rollout devices; each shard takes them at its next boundary."""
        self.wait_swapped()
        engine_params = self.engine.convert(params)
        with self._cond:
            self._pending, self._took = (engine_params, version), set()
            self._cond.notify_all()
        self.dealer.wake()

    def wait_swapped(self) -> None:
        """Waits until every shard runs the last staged weights."""
        with self._cond:
            while self._pending is not None:
                self.check()
                if not self._groups:  # idle shards take weights at their next wake-up
                    self.dealer.wake()
                self._cond.wait(0.1)

    def drain(self) -> None:
        """Waits until no row is in flight (what a sync without partial rollouts waits for)."""
        with self._cond:
            while self._groups:
                self.check()
                self._cond.wait(0.5)

    def pause(self) -> dict:
        """Parks every shard at a decode boundary and returns the rows in flight: their groups' metas, prompts and
        tokens so far ({"metas", "prompts", "tokens", "logprobs", "versions", "lengths"}); `resume` lets them go."""
        with self._cond:
            self._paused += 1
            busy = len(self.engine.local_shards)
            while self._parked < busy and self._groups:
                self.check()
                self.dealer.wake()
                self._cond.wait(0.1)
            groups = sorted(self._groups.values(), key=lambda g: g.slot)
            rid = np.asarray([r.rid for g in groups for r in g.rows], np.int64)
            return dict(metas=[g.meta for g in groups], prompts=[g.prompt.tolist() for g in groups],
                        tokens=self.store.tokens[rid].copy(), logprobs=self.store.logps[rid].copy(),
                        versions=self.store.versions[rid].copy(), lengths=self.store.lengths[rid].copy())

    def resume(self) -> None:
        with self._cond:
            self._paused -= 1
            self._cond.notify_all()

    def close(self, abort: bool = False) -> None:
        """Lets the shards finish what they hold (or, `abort`, drops it), then stops them and frees the pools."""
        if abort:
            self._aborting = True
            with self.dealer._cond:
                for q in self.dealer.queues:
                    q.clear()
            with self._cond:
                self._paused = 0
                self._cond.notify_all()
        self.dealer.close()
        self._thread.join()
        self.engine.release()
        if not abort:
            self.check()
