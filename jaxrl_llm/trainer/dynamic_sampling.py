"""DAPO's dynamic sampling (veRL's `algorithm.filter_groups`): keep only the groups that teach something.

A group (the n responses to one prompt) whose filter metric is the same for every response has zero
group-relative advantage, so it adds no gradient and only dilutes the batch. With filtering on, the
loop scores a prompt batch, keeps its groups whose metric varies, and draws, generates and scores the
next prompt batch until the kept groups reach `data.train_batch_size` prompts; the batch is then cut to
exactly that many prompts, earlier draws first (veRL's order). At most `max_num_gen_batches` prompt
batches are drawn a step (<= 0: no limit); running out is an error, as in veRL.

Every decision here uses the gathered scores, so every process of a multi-process run makes the same one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl_llm.trainer.batch import TrainBatch
from jaxrl_llm.trainer.config import ConfigValueError, FilterGroupsSettings


@dataclasses.dataclass
class ScoredDraw:
    """The scored responses of one or more prompt batches (every process holds all of them).

    Attributes:
      batch: the responses; `group_ids` dense over the prompts, in draw order.
      scores: [R] float32, the score of each response (after any reward shaping, before any KL penalty).
      extra_info: per-response extras of the reward function ([R] lists, None where a response lacks one).
      counts: `reward/num_errors`, `reward/num_nonfinite` over every response scored.
      exposed_s: seconds of scoring on the critical path after the device's passes were done.
    """

    batch: TrainBatch
    scores: np.ndarray
    extra_info: dict[str, list]
    counts: dict[str, int]
    exposed_s: float = 0.0

    def select(self, idx: np.ndarray) -> ScoredDraw:
        """The responses `idx`, with their groups renumbered densely (in order of first appearance)."""
        idx = np.asarray(idx, np.int64)
        batch = self.batch.select(idx)
        batch.group_ids = _dense(batch.group_ids)
        extras = {k: [v[i] for i in idx] for k, v in self.extra_info.items()}
        return ScoredDraw(batch, self.scores[idx], extras, dict(self.counts), self.exposed_s)


def _dense(group_ids: np.ndarray) -> np.ndarray:
    """Group ids renumbered 0..G-1 in order of first appearance."""
    _, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))
    return rank[inverse].astype(np.int32)


def concat_draws(draws: Sequence[ScoredDraw]) -> ScoredDraw:
    """One ScoredDraw of several, in order; the groups of a later draw come after every earlier group."""
    if len(draws) == 1:
        return draws[0]
    offsets = np.cumsum([0] + [int(d.batch.group_ids.max()) + 1 if len(d.batch) else 0 for d in draws[:-1]])
    fields = {k: np.concatenate([d.batch.fields[k] for d in draws]) for k in draws[0].batch.fields}
    group_ids = np.concatenate([d.batch.group_ids + o for d, o in zip(draws, offsets)]).astype(np.int32)
    batch = TrainBatch(prompt_ids=[p for d in draws for p in d.batch.prompt_ids],
                       responses=np.concatenate([d.batch.responses for d in draws]),
                       response_mask=np.concatenate([d.batch.response_mask for d in draws]),
                       group_ids=group_ids, fields=fields)
    keys = list(dict.fromkeys(k for d in draws for k in d.extra_info))
    extras = {k: [v for d in draws for v in d.extra_info.get(k, [None] * len(d.batch))] for k in keys}
    counts = {k: sum(d.counts.get(k, 0) for d in draws) for k in draws[0].counts}
    return ScoredDraw(batch, np.concatenate([d.scores for d in draws]), extras, counts,
                      sum(d.exposed_s for d in draws))


def extra_info_values(extra_info: dict[str, list], key: str, *, binding: str) -> np.ndarray:
    """[R] float64 values of one key of the reward function's extra info.

    A response without the key (its reward function failed, and it scored 0) counts as 0. A key the
    reward function never returned, or a value that is not a number, is one error naming `binding`.
    """
    if key not in extra_info:
        raise ConfigValueError(
            f"{binding}: {key!r} is not a key the reward function returns (it returns "
            f"{sorted(extra_info) if extra_info else 'a plain score, no dict'}); return it from the reward "
            "function (a dict with 'score' and the key) or use one of those keys")
    out = np.zeros(len(extra_info[key]), np.float64)
    for i, v in enumerate(extra_info[key]):
        if v is None:
            continue
        try:
            out[i] = float(v)
        except (TypeError, ValueError):
            raise ConfigValueError(f"{binding}: the reward function's {key!r} is {v!r} ({type(v).__name__}), "
                                   "not a number; use a numeric key") from None
    return out


def extra_info_fields(extra_info: dict[str, list], keys, *, binding: str, prefix: str) -> dict[str, np.ndarray]:
    """`{prefix + key: [R] float32}` for each key (GDPO's per-component rewards, `score/<key>`)."""
    return {prefix + k: extra_info_values(extra_info, k, binding=binding).astype(np.float32) for k in keys}


def filter_metric_values(scores: np.ndarray, extra_info: dict[str, list], metric: str) -> np.ndarray:
    """[R] float64 values the groups are judged by: the scores for "reward" (after any reward shaping,
    before any KL penalty), else the reward function's extra-info key `metric`."""
    if metric == "reward":
        return np.asarray(scores, np.float64)
    return extra_info_values(extra_info, metric, binding="algorithm.filter_groups.metric")


def compute_filter_groups_mask(values: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Which responses belong to a group worth keeping: one whose values are not all the same.

    A group of a single response is kept (it cannot be judged; veRL keeps it too). A NaN makes a group
    look constant, so it is dropped (as veRL's std > 0 test does).

    Args:
      values: [R] float, the filter metric of each response.
      group_ids: [R] int, responses to the same prompt share an id.
    Returns:
      [R] bool.
    """
    values = np.asarray(values, np.float64)
    _, inverse = np.unique(np.asarray(group_ids), return_inverse=True)
    g = int(inverse.max()) + 1 if len(inverse) else 0
    hi = np.full(g, -np.inf)
    lo = np.full(g, np.inf)
    with np.errstate(invalid="ignore"):  # NaN values: their group compares unequal, and is dropped
        np.maximum.at(hi, inverse, values)
        np.minimum.at(lo, inverse, values)
    keep = (hi > lo) | (np.bincount(inverse, minlength=g) == 1)
    return keep[inverse]


def draw_seed(data_seed: int, step: int, draw: int) -> int:
    """The sampling seed of prompt batch `draw` of `step`: a pure function of the three, so a resumed
    run samples exactly what an uninterrupted one did. Draw 0 keeps the seed of a run without filtering."""
    if draw == 0:
        return data_seed * 100003 + step
    return int(np.random.SeedSequence([data_seed, step, draw]).generate_state(1)[0] & 0x7FFFFFFF)


class GroupFilter:
    """Collects the kept groups of a step's draws until there are `train_batch_size` of them.

    Usage: `add` each scored draw; stop when `full`, else `check_budget()` (raises when no more draws are
    allowed) and draw again; `result()` is the batch of exactly `train_batch_size` prompts.
    """

    def __init__(self, settings: FilterGroupsSettings, train_batch_size: int):
        self.metric = settings.metric
        self.max_num_gen_batches = settings.max_num_gen_batches
        self.train_batch_size = train_batch_size
        self.parts: list[ScoredDraw] = []
        self.num_gen_batches = 0
        self.kept = 0  # groups
        self.dropped = 0

    def add(self, draw: ScoredDraw) -> None:
        values = filter_metric_values(draw.scores, draw.extra_info, self.metric)
        keep = compute_filter_groups_mask(values, draw.batch.group_ids)
        groups = len(np.unique(draw.batch.group_ids))
        kept = len(np.unique(draw.batch.group_ids[keep]))
        self.num_gen_batches += 1
        self.kept += kept
        self.dropped += groups - kept
        self.parts.append(draw.select(np.flatnonzero(keep)))  # keeps the counts: every response scored counts

    @property
    def full(self) -> bool:
        return self.kept >= self.train_batch_size

    def check_budget(self) -> None:
        """Raises when `max_num_gen_batches` prompt batches were drawn without filling the batch."""
        limit = self.max_num_gen_batches
        if limit > 0 and self.num_gen_batches >= limit:
            raise ConfigValueError(
                f"algorithm.filter_groups.max_num_gen_batches: {self.num_gen_batches} prompt batches drawn this "
                f"step kept only {self.kept} of the {self.train_batch_size} groups needed (the "
                f"{self.dropped} others had the same {self.metric!r} for every response); the prompts are too "
                "easy or too hard for the model. Raise max_num_gen_batches (<= 0: no limit), raise rollout.n, "
                "or use other data")

    def result(self) -> ScoredDraw:
        """The kept groups, cut to exactly `train_batch_size` prompts (earlier draws first)."""
        merged = concat_draws(self.parts)
        return merged.select(np.flatnonzero(merged.batch.group_ids < self.train_batch_size))

    def metrics(self) -> dict[str, float]:
        """veRL's `train/num_gen_batches` and its V1 buffer's filter_groups counts (in prompt groups)."""
        drawn = self.kept + self.dropped
        return {"train/num_gen_batches": self.num_gen_batches,
                "training/filter_groups/evicted_samples": self.dropped,
                "training/filter_groups/discarded_surplus_samples": max(self.kept - self.train_batch_size, 0),
                "filter_groups/kept_groups": self.kept,
                "filter_groups/kept_ratio": self.kept / drawn if drawn else 0.0}
