"""Scoring one step's responses: decode, score this process's share, gather the scores everywhere.

The driver calls `StepScorer.score` while the device runs the step's log-prob passes, so the reward is
off the critical path. Each process of a multi-process run decodes and scores only its contiguous share
of the responses; the shares are gathered, so every process holds every score (the advantages and every
later decision use them). Scoring goes in chunks, and between chunks the scorer asks whether the device
has finished (`device_done`): the time spent scoring after that point is the reward's exposed time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl_llm import distributed
from jaxrl_llm.rewards import RewardManager


@dataclasses.dataclass
class StepScores:
    """Scores of R responses (every process holds all of them).

    Attributes:
      scores: [R] float32.
      metrics: `reward/num_errors`, `reward/num_nonfinite` over all R.
      extra_info: per-response extras of reward functions that return dicts ([R] lists).
      exposed_s: seconds this process spent scoring after the device had finished its passes.
    """

    scores: np.ndarray
    metrics: dict[str, int]
    extra_info: dict[str, list]
    exposed_s: float = 0.0


def assistant_spans(ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """The runs of mask-1 tokens of one response ([T] ids and mask): its assistant turns (one run for a
    single-turn response)."""
    m = np.concatenate([[0], (np.asarray(mask) > 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))  # starts and ends of the runs, alternating
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2])]


def decode_responses(tokenizer, sequences: Sequence[Sequence[int]]) -> list[str]:
    """Response texts without special tokens; the Rust batch decoder of a fast tokenizer (parallel,
    several times faster than `batch_decode`) when it gives the same text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode_batch([list(map(int, s)) for s in sequences], skip_special_tokens=True)
    return tokenizer.batch_decode(sequences, skip_special_tokens=True)


class StepScorer:
    """Decodes and scores responses with `rewards`, split across the processes of the run."""

    def __init__(self, tokenizer, rewards: RewardManager, *, chunk: int = 256):
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.chunk = chunk

    def score(self, items: Sequence[dict], responses: np.ndarray, mask: np.ndarray,
              device_done: Callable[[], bool] | None = None) -> StepScores:
        """Scores response i against `items[i]` (a dataset row: data_source, ground_truth, extra_info).
        The text scored is the assistant's alone: the mask-1 tokens of each turn decoded, the turns joined
        by newlines (a tool's output never reaches the reward).

        Args:
          items: [R] dataset rows, one per response.
          responses: [R, T] int token ids.
          mask: [R, T] the loss mask (1 on sampled assistant tokens).
          device_done: polled between chunks; True once the device work that scoring overlaps is done.
        """
        share = distributed.share(len(items))
        scores, problems, extras = [], {"reward/num_errors": 0, "reward/num_nonfinite": 0}, {}
        ready_at = None
        idx = range(share.start, share.stop)
        for c0 in range(0, len(idx), self.chunk):
            if ready_at is None and device_done is not None and device_done():
                ready_at = time.perf_counter()
            rows = idx[c0:c0 + self.chunk]
            spans = [assistant_spans(responses[i], mask[i]) for i in rows]
            flat = decode_responses(self.tokenizer, [s for turns in spans for s in turns])
            bounds = np.cumsum([0] + [len(turns) for turns in spans])
            texts = ["\n".join(flat[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
            its = [items[i] for i in rows]
            out = self.rewards.score_batch([it["data_source"] for it in its], texts,
                                           [it["ground_truth"] for it in its], [it.get("extra_info") for it in its])
            scores.append(out.scores)
            for k, v in out.metrics.items():
                problems[k] = problems.get(k, 0) + int(v)
            for k, vals in out.extra_info.items():
                extras.setdefault(k, [None] * c0)
                extras[k].extend(vals)
            for k in extras:  # keys some chunks did not report
                extras[k].extend([None] * (c0 + len(rows) - len(extras[k])))
        if ready_at is None and device_done is not None and device_done():
            ready_at = time.perf_counter()
        exposed = time.perf_counter() - ready_at if ready_at is not None else 0.0
        mine = np.concatenate(scores) if scores else np.zeros(0, np.float32)
        local = (mine, problems, extras, share.stop - share.start)
        return _merge(distributed.allgather_objects(local), exposed)


def _merge(parts: list, exposed: float) -> StepScores:
    """The per-process (scores, counts, extras, n) in process order -> one StepScores."""
    scores = np.concatenate([p[0] for p in parts]).astype(np.float32)
    metrics = {k: sum(p[1][k] for p in parts) for k in parts[0][1]}
    keys = list(dict.fromkeys(k for p in parts for k in p[2]))
    extras = {k: [v for p in parts for v in p[2].get(k, [None] * p[3])] for k in keys}
    return StepScores(scores, metrics, extras, exposed)
