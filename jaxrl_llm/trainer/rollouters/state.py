"""What an asynchronous trainer keeps between its two sides: rollouts built from streamed groups, the staleness and
partial-rollout metrics (veRL's names where it has them), and the state a checkpoint at a sync point carries
(the rollouts generated but not trained on yet, the rows still in flight), packed into the JSON meta."""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time

import numpy as np

from jaxrl_llm.rollout import RolloutBatch


def pack(arrays: dict[str, np.ndarray]) -> str:
    """Arrays as one base64 .npz string (a checkpoint's JSON meta holds it)."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def unpack(text: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(base64.b64decode(text))) as f:
        return {k: f[k] for k in f.files}


def pack_obj(obj) -> str:
    """Python objects (prompt dicts, streamed groups) as one base64 pickle string (this run's own checkpoint)."""
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def unpack_obj(text: str | None):
    return None if text is None else pickle.loads(base64.b64decode(text))


def batch_arrays(b: RolloutBatch) -> dict[str, np.ndarray]:
    """A RolloutBatch as plain arrays (to pack)."""
    out = dict(prompt_index=b.prompt_index, tokens=b.tokens, logprobs=b.logprobs, lengths=b.lengths,
               stop=np.asarray([r == "stop" for r in b.finish_reasons], np.int8),
               weight_version=np.asarray(b.weight_version))
    if b.token_versions is not None:
        out["token_versions"] = b.token_versions
    return out


def batch_from_arrays(a: dict[str, np.ndarray]) -> RolloutBatch:
    return RolloutBatch(prompt_index=a["prompt_index"], tokens=a["tokens"], logprobs=a["logprobs"],
                        lengths=a["lengths"], finish_reasons=["stop" if s else "length" for s in a["stop"]],
                        weight_version=int(a["weight_version"]), token_versions=a.get("token_versions"))


def batch_from_groups(groups, pad_id: int, version: int) -> RolloutBatch:
    """One RolloutBatch (prompt-major) from streamed `GroupResult`s, in the given order."""
    n = groups[0].tokens.shape[0]
    width = max(int(g.lengths.max()) for g in groups)
    tokens = np.full((len(groups) * n, width), pad_id, np.int32)
    logps = np.zeros((len(groups) * n, width), np.float32)
    versions = np.zeros((len(groups) * n, width), np.int32)
    for i, g in enumerate(groups):
        w = g.tokens.shape[1]
        tokens[i * n:(i + 1) * n, :w] = g.tokens
        logps[i * n:(i + 1) * n, :w] = g.logprobs
        versions[i * n:(i + 1) * n, :w] = g.versions
    return RolloutBatch(prompt_index=np.repeat(np.arange(len(groups)), n), tokens=tokens, logprobs=logps,
                        lengths=np.concatenate([g.lengths for g in groups]).astype(np.int32),
                        finish_reasons=[r for g in groups for r in g.finish_reasons], weight_version=version,
                        token_versions=versions)


class BusyClock:
    """Seconds a side has spent working, summed, the stretch under way counted up to now (one_step_off's rollout
    thread, around each generation; the stream keeps the same for fully_async). The difference of two readings is
    the work done between them, whenever it started: a step's busy time is measured over that step's own wall."""

    def __init__(self):
        self._lock = threading.Lock()
        self._total, self._since = 0.0, None

    def start(self) -> None:
        with self._lock:
            self._since = time.perf_counter()

    def stop(self) -> None:
        with self._lock:
            if self._since is not None:
                self._total += time.perf_counter() - self._since
                self._since = None

    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._since is not None else 0.0)


def overlap_metrics(*, wait: float, step_s: float, busy: float, wall: float, version: int) -> dict[str, float]:
    """How each side spent the step: the trainer waiting for rollouts (`wait` of its `step_s`), the rollout devices
    with rows in flight (`busy` of the `wall` seconds they had), and the weights' version the rollout side runs."""
    return {"timing_s/wait_prev_gen": wait, "trainer/idle_ratio": wait / step_s,
            "rollouter/active_time": busy, "rollouter/idle_ratio": max(0.0, 1 - busy / wall),
            "timing_s/rollout_wait": max(0.0, wall - busy), "fully_async/version": float(version)}


def staleness_metrics(batch: RolloutBatch, version: int, n: int) -> dict[str, float]:
    """How far behind the trainer's weights (`version`) the batch's tokens were sampled, per sample (a prompt's n
    rows): fully_async/staleness/{mean,max}, veRL's stale counts and partial-rollout metrics for this step."""
    if batch.token_versions is None:
        return {}
    mask = np.arange(batch.tokens.shape[1])[None, :] < batch.lengths[:, None]
    v = np.where(mask, batch.token_versions, np.iinfo(np.int32).max)
    oldest = v.reshape(-1, n, v.shape[1]).min(axis=(1, 2))  # [prompts]
    newest = np.where(mask, batch.token_versions, -1).reshape(-1, n, v.shape[1]).max(axis=(1, 2))
    lag = version - oldest
    span = np.maximum(newest - oldest, 0)
    stale = lag > 0
    return {"fully_async/staleness/mean": float(lag.mean()), "fully_async/staleness/max": float(lag.max()),
            "fully_async/count/stale_samples_processed": float(stale.sum()),
            "fully_async/count/stale_trajectory_processed": float(stale.sum() * n),
            "fully_async/partial/total_partial_num": float((span > 0).sum()),
            "fully_async/partial/partial_ratio": float((span > 0).mean()),
            "fully_async/partial/max_partial_span": float(span.max())}


def mean_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Local updates' metrics as one step's: counts and timings add up, everything else is averaged."""
    keys = {k for p in parts for k in p}
    summed = ("timing_s/", "fully_async/count/", "fully_async/partial/total_partial_num", "perf/total_num_tokens",
              "perf/compiles", "perf/compile_s")
    out = {}
    for k in keys:
        vals = [p[k] for p in parts if k in p and isinstance(p[k], (int, float))]
        if vals:
            out[k] = float(np.sum(vals)) if k.startswith(summed) else float(np.mean(vals))
    for k in ("fully_async/staleness/max", "fully_async/partial/max_partial_span", "response_length/max"):
        vals = [p[k] for p in parts if k in p]
        if vals:
            out[k] = float(np.max(vals))
    return out
