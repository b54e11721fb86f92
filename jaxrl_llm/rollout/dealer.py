"""Deals a request's prompt groups to the engine's data-parallel shards before any of them admits a row.

A prompt's `n` samples stay together (they share the prompt's pages on one shard). Groups go to shards
largest first, each to the shard with the least work so far (work: prompt tokens plus response budgets),
so every shard starts with an even share. A shard takes its own groups in that order; once its own are all
admitted it may take a group that another shard of the same process cannot admit yet (its slots or pages are
full: "stealing"), so no shard idles while another still has rows waiting. No shard ever waits for another
shard's rows.

The deal is a pure function of the request, so every process computes the same one. Stealing depends on
timing, so it only happens where each shard is driven by one process (a shard whose devices span processes
is run by each of them in lockstep, from its own groups alone).
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from jaxrl_llm.rollout.scheduler import Row


def deal(groups: list[list[Row]], shards: int) -> list[list[list[Row]]]:
    """[shard][k]: the groups each shard runs, largest first (longest-processing-time first, ties by order)."""
    cost = [sum(len(r.ids) + r.max_tokens for r in g) for g in groups]
    load = np.zeros(shards, np.int64)
    out: list[list[list[Row]]] = [[] for _ in range(shards)]
    for i in sorted(range(len(groups)), key=lambda i: (-cost[i], i)):
        s = int(np.argmin(load))
        out[s].append(groups[i])
        load[s] += cost[i]
    return out


class Dealer:
    """The shards' queues of prompt groups; `source(shard)` is what a shard's scheduler takes rows from.

    Args:
      dealt: [shard][k] groups (see `deal`).
      local: the shards this process drives.
      steal: whether a shard may take another local shard's groups once its own run out.
    """

    def __init__(self, dealt: list[list[list[Row]]], local: list[int], *, steal: bool):
        self.dealt = dealt
        self.queues = [deque(q) for q in dealt]
        self.local = list(local)
        self.steal = steal
        self.stolen = 0
        self.blocked = [False] * len(dealt)  # a shard whose own next group waits for its slots or pages
        self._lock = threading.Lock()

    def source(self, shard: int) -> _ShardSource:
        return _ShardSource(self, shard)

    def _take(self, shard: int, fits) -> list[Row] | None:
        with self._lock:
            own = self.queues[shard]
            if own:
                self.blocked[shard] = not fits(own[0][0])
                return None if self.blocked[shard] else own.popleft()
            if not self.steal:
                return None
            others = [s for s in self.local if s != shard and self.queues[s] and self.blocked[s]]
            if not others:
                return None
            victim = max(others, key=lambda s: (sum(len(g) for g in self.queues[s]), -s))
            group = self.queues[victim][-1]
            if not fits(group[0]):
                return None
            self.stolen += 1
            return self.queues[victim].pop()

    def _full(self, shard: int) -> None:
        with self._lock:
            self.blocked[shard] = bool(self.queues[shard])

    def _pending(self, shard: int) -> bool:
        with self._lock:
            if self.queues[shard]:
                return True
            return self.steal and any(self.queues[s] and self.blocked[s] for s in self.local if s != shard)


class _ShardSource:
    """One shard's view of the dealer (the scheduler's `RowSource`)."""

    def __init__(self, dealer: Dealer, shard: int):
        self.dealer, self.shard = dealer, shard

    def take(self, fits) -> list[Row] | None:
        return self.dealer._take(self.shard, fits)

    def pending(self) -> bool:
        return self.dealer._pending(self.shard)

    def full(self) -> None:
        self.dealer._full(self.shard)
