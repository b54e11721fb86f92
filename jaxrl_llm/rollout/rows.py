"""A request's rows: each response a row (`Row`), their sampled tokens in one store (`RowStore`), and where a shard's
scheduler takes them from (`RowSource`: the engine's dealer, rollout/dealer.py, or a fixed `ListSource`).

A row's positions: its context is prompt + sampled tokens. All but the last context token are in its pages; the
last one ("pending") is fed by the next decode step (rollout/scheduler.py).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Protocol

import numpy as np


class RowStore:
    """The sampled tokens of every row of a request: [R, T] tokens, their log-probs and the weight version that
    sampled each, and [R] lengths, written in place by the shards (each row by the one shard that runs it)."""

    def __init__(self, rows: int, width: int, pad_id: int):
        self.tokens = np.full((rows, max(1, width)), pad_id, np.int32)
        self.logps = np.zeros((rows, max(1, width)), np.float32)
        self.versions = np.zeros((rows, max(1, width)), np.int32)
        self.lengths = np.zeros(rows, np.int32)


@dataclasses.dataclass(eq=False)
class Row:
    """One response of a request."""

    rid: int  # index in the request (prompt-major: response j of prompt i is i * n + j)
    prompt: int  # which prompt it answers
    ids: np.ndarray  # [P] int32, the prompt's token ids
    max_tokens: int
    store: RowStore
    stream: int = 0  # seeds the row's random draws (the engine's `seeds`; its rid by default)
    key: np.ndarray | None = None  # [2] int32: its request's PRNG key data (key(seed), bit-cast)
    finished: bool = False
    preemptions: int = 0
    # Routing replay R3: [positions, L_moe, k] experts of each context position the engine ran (-1: not yet)
    routes: np.ndarray | None = None

    @property
    def ntok(self) -> int:
        return int(self.store.lengths[self.rid])

    @property
    def tokens(self) -> np.ndarray:
        return self.store.tokens[self.rid, : self.ntok]

    @property
    def context_len(self) -> int:
        """Tokens whose K/V the row needs before its next step: everything but the pending token."""
        return len(self.ids) + self.ntok - 1

    @property
    def pending(self) -> int:
        return int(self.store.tokens[self.rid, self.ntok - 1]) if self.ntok else int(self.ids[-1])

    def context(self) -> np.ndarray:
        return np.concatenate([self.ids, self.tokens]).astype(np.int32)


class RowSource(Protocol):
    """Where a shard's scheduler takes its rows from (the engine's dealer)."""

    def take(self, fits) -> list[Row] | None:
        """The next prompt group for this shard if `fits(first row)`, else None."""

    def pending(self) -> bool:
        """Whether `take` may still return rows."""

    def full(self) -> None:
        """Says that the shard's slots are all taken (its next group waits: another shard may take it)."""

    def wait(self) -> None:
        """Blocks (briefly) while nothing can be taken now but rows may still come."""


class ListSource:
    """A fixed list of rows in prompt groups, for one shard (tests, and a single-shard engine)."""

    def __init__(self, rows: list[Row]):
        self.groups: deque[list[Row]] = deque()
        for r in rows:
            if self.groups and self.groups[-1][0].prompt == r.prompt:
                self.groups[-1].append(r)
            else:
                self.groups.append([r])

    def take(self, fits) -> list[Row] | None:
        if self.groups and fits(self.groups[0][0]):
            return self.groups.popleft()
        return None

    def pending(self) -> bool:
        return bool(self.groups)

    def full(self) -> None:
        pass

    def wait(self) -> None:
        pass
