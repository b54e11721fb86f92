"""Fully asynchronous (`async_training.mode = 'fully_async'`, veRL's fully_async_policy): the rollout devices run a
rollout stream (rollout/stream.py) that a feeder thread fills with prompt groups, at most (1 + staleness_threshold)
steps of them ahead of the trainer; finished groups queue up.

A step takes `require_batches` x `ppo_mini_batch_size` groups a local update, in (batch, prompt) order, drops those
whose oldest token is more than `max_version_lag` versions behind (counted, and their place freed for fresh
prompts), and after `trigger_parameter_sync_step` local updates sends new weights, which the stream's shards take
at their next decode boundary (`partial_rollout`) or once the rows in flight are done; the feeder submits nothing
meanwhile. The update is the decoupled objective: the trainer's own log-probs as the proximal policy, the
sampler's through algorithm.rollout_correction.

A checkpoint is written at a sync point and carries the queued groups, the groups in flight and the prompts drawn
but not yet submitted. Without partial rollouts a sync drains the stream first, so every group in flight at a
checkpoint was prefilled and sampled at the checkpoint's weights: on resume it starts again from its prompt, with
its own seed and random streams, and samples exactly what it would have (a prefill of its tokens so far would not:
that program's K/V differ from the decode's in the last bits, and a sampled token can flip). With partial rollouts a
group's tokens may span versions, so it keeps its tokens so far, prefilled again on resume.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections import deque

from jaxrl_llm.data.iterator import PromptBatch
from jaxrl_llm.rollout import RolloutError
from jaxrl_llm.rollout.stream import GroupResult
from jaxrl_llm.trainer.dynamic_sampling import draw_seed
from jaxrl_llm.trainer.metrics import Timer
from jaxrl_llm.trainer.roles.protocols import StreamingEngine
from jaxrl_llm.trainer.rollout_batch import Rollout, build_train_batch, response_items
from jaxrl_llm.trainer.rollouters.base import RolloutSource, refuse_prompts
from jaxrl_llm.trainer.rollouters.state import (
    batch_from_groups,
    overlap_metrics,
    pack,
    pack_obj,
    staleness_metrics,
    unpack,
    unpack_obj,
)

MODE = "fully_async"


class FullyAsync:
    """The rollout stream and its feeder. `saved`: a checkpoint's state of this mode, or None."""

    def __init__(self, trainer: RolloutSource, saved: dict | None):
        self.trainer = trainer
        self.engine: StreamingEngine = trainer.engine
        self.cfg, self.n = trainer.run.async_training, trainer.run.rollout.n
        self._saved = saved
        self._stream = None
        self._queue: queue.Queue[GroupResult] = queue.Queue()  # the finished groups
        self._cond = threading.Condition()
        self._feeder: threading.Thread | None = None
        self._stop = False
        self._syncing = False
        self._drawn: deque = deque()  # (batch, index, prompt) drawn from the data, not yet submitted
        self._batches = self._submitted = self._dropped = 0
        self._busy0 = self._wall0 = self._t_step = self._waited = 0.0
        self._version = trainer.global_step  # the weights' version the rollout side runs
        if saved and "batches" in saved:
            self._batches, self._submitted, self._dropped = saved["batches"], saved["submitted"], saved["dropped"]
            self._drawn = deque(unpack_obj(saved["drawn"]))

    # ---- the stream and its feeder -------------------------------------------------------------------
    def _start_stream(self) -> None:
        self._version = self.trainer.global_step
        self.engine.sync(self._version)
        per_step = self.trainer.run.data.train_batch_size
        capacity = math.ceil((1 + self.cfg.staleness_threshold) * per_step) + per_step
        self._stream = self.engine.stream(self.trainer.sampling(0), capacity=capacity, on_group=self._queue.put,
                                          kv=self.cfg.partial_rollout_kv)
        self._busy0, self._wall0 = self._stream.busy_seconds(), time.perf_counter()
        if self._saved is not None:  # resumed: the queued groups, then the rows that were in flight
            s, self._saved = self._saved, None
            for g in unpack_obj(s.get("queued")) or []:
                self._queue.put(g)
            flight = s.get("in_flight")
            if flight is not None:
                snap = None if flight.get("rows") is None else unpack(flight["rows"])
                metas = unpack_obj(flight["metas"])
                for i, meta in enumerate(metas):
                    rows = slice(i * self.n, (i + 1) * self.n)
                    self._stream.submit([meta["prompt"]["prompt_ids"]], [meta], seed=self._seed(meta["batch"]),
                                        streams=[meta["index"] * self.n + j for j in range(self.n)],
                                        partial=None if snap is None else {k: v[rows] for k, v in snap.items()})
        self._stop = False
        self._feeder = threading.Thread(target=self._feed, name="rollouter", daemon=True)
        self._feeder.start()

    def _stop_stream(self, abort: bool = False) -> None:
        if self._stream is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._feeder.join()
        stream, self._stream = self._stream, None
        stream.close(abort=abort)

    def _seed(self, batch: int) -> int:
        return draw_seed(self.trainer.run.data.seed, batch, 0)

    def _allowed(self) -> int:
        """Prompts the rollout side may have submitted (net of the dropped ones) by now."""
        return math.floor((self._version + 1 + self.cfg.staleness_threshold) * self.trainer.run.data.train_batch_size)

    def _feed(self) -> None:
        """The feeder: draws prompts and submits them, one group at a time, within the staleness bound."""
        try:
            while True:
                with self._cond:
                    while not self._stop and (self._syncing or self._submitted - self._dropped >= self._allowed()):
                        self._cond.wait(0.5)
                    if self._stop:
                        return
                    if not self._drawn:
                        b = self._batches
                        self._drawn.extend((b, i, p) for i, p in enumerate(next(self.trainer.iterator)))
                        self._batches += 1
                    b, i, prompt = self._drawn.popleft()
                    self._submitted += 1
                    # Under the lock: a checkpoint finds each drawn prompt either still drawn or in the stream.
                    self._stream.submit([prompt["prompt_ids"]], [{"batch": b, "index": i, "prompt": prompt}],
                                        seed=self._seed(b), streams=[i * self.n + j for j in range(self.n)])
        except BaseException as e:  # noqa: BLE001 (the trainer's thread raises it: `_groups`)
            self._stream.error = self._stream.error or e

    # ---- a step --------------------------------------------------------------------------------------
    def _groups(self, count: int) -> tuple[list[GroupResult], float, int]:
        """`count` groups within the staleness bound, in (batch, prompt) order; the seconds waited and how many
        were dropped as too stale."""
        out, waited, dropped = [], 0.0, 0
        bound = self.cfg.version_bound
        while len(out) < count:
            t0 = time.perf_counter()
            try:
                g = self._queue.get(timeout=0.5)
            except queue.Empty:
                waited += time.perf_counter() - t0
                self._stream.check()
                if self._feeder is not None and not self._feeder.is_alive() and self._queue.empty():
                    raise RolloutError("the rollouter thread stopped; see the log above") from None
                continue
            waited += time.perf_counter() - t0
            if self._version - g.oldest_version > bound:
                dropped += 1
                with self._cond:
                    self._dropped += 1  # frees its place within the bound
                    self._cond.notify_all()
                continue
            out.append(g)
        out.sort(key=lambda g: (g.meta["batch"], g.meta["index"]))
        return out, waited, dropped

    def take(self, k: int, prompts: list[dict] | None = None):
        refuse_prompts(prompts, MODE)
        if self._stream is None:
            self._start_stream()
        self._t_step, self._waited = time.perf_counter(), 0.0
        t, a = self.trainer, self.cfg
        for _ in range(a.trigger_parameter_sync_step):
            groups, waited, dropped = self._groups(a.require_batches * t.run.actor.ppo_mini_batch_size)
            self._waited += waited
            # the epoch of the (first) data batch these groups were drawn in: the feeder draws batch b as the run's
            # b-th, one draw a batch
            epoch = groups[0].meta["batch"] // t.iterator.steps_per_epoch
            prompts = PromptBatch([g.meta["prompt"] for g in groups], epoch)
            sampled = batch_from_groups(groups, self.engine.pad_id, self.engine.version)
            d = t.run.data
            yield Rollout(build_train_batch(prompts, sampled, d.max_response_length, d.max_prompt_length),
                          response_items(prompts, sampled), prompts=prompts,
                          metrics={**staleness_metrics(sampled, k, self.n), "timing_s/wait_prev_gen": waited,
                                   "fully_async/count/stale_samples_dropped": float(dropped)})

    def sync(self, version: int, clock: Timer) -> dict[str, float]:
        """New weights to the stream: at the shards' next boundary (partial rollouts), or once the rows in flight
        are done; the feeder submits nothing meanwhile. The step's sync and overlap figures."""
        t0 = time.perf_counter()
        with self._cond:
            self._syncing = True
        try:
            if not self.cfg.partial_rollout:
                self._stream.drain()
            self.engine.stage(self._stream, version)
            if not self.cfg.partial_rollout:
                self._stream.wait_swapped()
        finally:
            with self._cond:
                self._version, self._syncing = version, False
                self._cond.notify_all()
        out = {"timing_s/sync": time.perf_counter() - t0, **self.engine.weight_sync_metrics()}
        now, busy_total = time.perf_counter(), self._stream.busy_seconds()
        out.update(overlap_metrics(wait=self._waited, step_s=now - self._t_step, busy=busy_total - self._busy0,
                                   wall=now - self._wall0, version=version))
        self._busy0, self._wall0 = busy_total, now
        out.update({"fully_async/queue_size": float(self._queue.qsize()),
                    "fully_async/count/stale_samples_dropped_total": float(self._dropped)})
        return out

    # ---- checkpoints, validation, the end -------------------------------------------------------------
    def checkpoint(self, save) -> None:
        stream = self._stream
        if stream is None:
            save({"async": {"mode": MODE}})
            return
        with self._cond:  # the feeder draws and submits nothing meanwhile
            flight = stream.pause()
            try:
                state = {"mode": MODE, "batches": self._batches, "submitted": self._submitted,
                         "dropped": self._dropped, "drawn": pack_obj(list(self._drawn)),
                         "queued": pack_obj(list(self._queue.queue)),
                         "in_flight": None if not flight["metas"] else {
                             "metas": pack_obj(flight["metas"]),
                             # their tokens so far, where resuming must continue them (the module's docstring)
                             "rows": None if not self.cfg.partial_rollout else pack(
                                 {k: flight[k] for k in ("tokens", "logprobs", "versions", "lengths")})}}
                save({"async": state})
            finally:
                stream.resume()

    @contextlib.contextmanager
    def idle(self):
        """Validation runs `generate` on the rollout devices: the stream stops meanwhile, and starts again after."""
        restart = self._stream is not None
        if restart:
            self._stop_stream()
        try:
            yield
        finally:
            if restart:
                self._start_stream()

    def close(self) -> None:
        self._stop_stream(abort=True)
