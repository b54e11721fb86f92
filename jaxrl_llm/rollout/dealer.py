"""Deals a request's prompt groups to the engine's data-parallel shards before any of them admits a row.

A prompt's `n` samples stay together (they share the prompt's pages on one shard). Groups go to shards
largest first, each to the shard with the least work so far (work: prompt tokens plus response budgets),
so every shard starts with an even share. A shard takes its own groups in that order; once its own are all
admitted it may take a group that another shard of the same process cannot admit yet (its slots or pages are
full: "stealing"), so no shard idles while another still has rows waiting. No shard ever waits for another
shard's rows.

A rollout stream (rollout/stream.py) keeps the dealer open: groups are submitted while the shards run (each to
the local shard with the fewest rows queued), and a shard with nothing to do waits for them until the stream
closes.

The deal is a pure function of the request, so every process computes the same one. Stealing depends on
timing, so it only happens where each shard is driven by one process (a shard whose devices span processes
is run by each of them in lockstep, from its own groups alone).
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from jaxrl_llm.rollout.rows import Row


def cost(group: list[Row]) -> int:
    return sum(len(r.ids) + r.max_tokens for r in group)


def deal(groups: list[list[Row]], shards: int) -> list[list[list[Row]]]:
    """[shard][k]: the groups each shard runs, largest first (longest-processing-time first, ties by order)."""
    costs = [cost(g) for g in groups]
    load = np.zeros(shards, np.int64)
    out: list[list[list[Row]]] = [[] for _ in range(shards)]
    for i in sorted(range(len(groups)), key=lambda i: (-costs[i], i)):
        s = int(np.argmin(load))
        out[s].append(groups[i])
        load[s] += costs[i]
    return out


class Dealer:
    """The shards' queues of prompt groups; `source(shard)` is what a shard's scheduler takes rows from.

    Args:
      dealt: [shard][k] groups (see `deal`).
      local: the shards this process drives.
      steal: whether a shard may take another local shard's groups once its own run out.
      open: a stream's dealer: more groups may come (`submit`) until `close`.
    """

    def __init__(self, dealt: list[list[list[Row]]], local: list[int], *, steal: bool, open: bool = False):
        self.dealt = dealt
        self.queues = [deque(q) for q in dealt]
        self.local = list(local)
        self.steal = steal
        self.open = open
        self.stolen = 0
        self.blocked = [False] * len(dealt)  # a shard whose own next group waits for its slots or pages
        self._cond = threading.Condition()

    def source(self, shard: int) -> _ShardSource:
        return _ShardSource(self, shard)

    def submit(self, groups: list[list[Row]]) -> None:
        """More groups (a stream's), each to the local shard with the fewest rows queued."""
        with self._cond:
            for g in groups:
                s = min(self.local, key=lambda s: (sum(len(q) for q in self.queues[s]), s))
                self.queues[s].append(g)
                self.dealt[s].append(g)
            self._cond.notify_all()

    def close(self) -> None:
        """No more groups: shards finish what they hold, then stop."""
        with self._cond:
            self.open = False
            self._cond.notify_all()

    def wake(self) -> None:
        """Wakes the shards that wait for rows (to take new weights, or to park for a pause)."""
        with self._cond:
            self._cond.notify_all()

    def _stealable(self, shard: int) -> list[int]:
        if not self.steal:
            return []
        return [s for s in self.local if s != shard and self.queues[s] and self.blocked[s]]

    def _take(self, shard: int, fits) -> list[Row] | None:
        with self._cond:
            own = self.queues[shard]
            if own:
                self.blocked[shard] = not fits(own[0][0])
                return None if self.blocked[shard] else own.popleft()
            others = self._stealable(shard)
            if not others:
                return None
            victim = max(others, key=lambda s: (sum(len(g) for g in self.queues[s]), -s))
            group = self.queues[victim][-1]
            if not fits(group[0]):
                return None
            self.stolen += 1
            return self.queues[victim].pop()

    def _full(self, shard: int) -> None:
        with self._cond:
            self.blocked[shard] = bool(self.queues[shard])
            if self.blocked[shard]:
                self._cond.notify_all()  # a waiting shard may take this one's next group

    def _pending(self, shard: int) -> bool:
        with self._cond:
            return bool(self.queues[shard]) or bool(self._stealable(shard)) or self.open

    def _wait(self, shard: int, timeout: float = 0.5) -> None:
        """Blocks while this shard has nothing to take and the stream stays open (bounded by `timeout`)."""
        with self._cond:
            if not self.queues[shard] and not self._stealable(shard) and self.open:
                self._cond.wait(timeout)


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

    def wait(self) -> None:
        self.dealer._wait(self.shard)
