"""The paged sampler's scheduler: which rows decode, which wait, and which pages each one holds.

Every response row of a `generate` call (prompts x n) starts in the waiting queue. Between decode
segments the engine asks for a `Plan`:

1. **Admission** (continuous batching): waiting rows take free decode slots, up to `max_num_seqs`,
   while their shard has pages for their context and a small watermark stays free. The first sample
   of a prompt prefills it; its siblings share the prompt's pages (reference-counted) and prefill
   nothing. A preempted row shares the prompt's full pages when a sibling still holds them.
2. **Growth**: every running row gets the pages its next `seg` tokens write, before the segment
   runs, so nothing is allocated on the device. A row about to write into a page that others share
   gets a private copy first (copy on write). When the pages do not cover a full segment, the
   segment is shortened; when they do not cover one step, the newest rows are preempted (vLLM's
   recompute mode: their pages are freed and they wait again at the front of the queue, keeping the
   tokens they have; on readmission their prompt and tokens are prefilled again).
3. **Slots**: running rows are packed into a bucket of slots per shard (at least 32, then 64, then
   four steps per doubling: 80, 96, 112, 128, 160, ...), so a segment's program comes from a fixed
   ladder of shapes, at most 25% of the slots are padding, and a batch whose rows finished runs smaller.

A row's positions: its context is prompt + sampled tokens. All but the last context token are in
its pages; the last one ("pending") is fed by the next decode step, which writes its K/V at
position `pos` and samples token `t` (= tokens sampled so far).

Pure host code, deterministic: every process of a multi-process run makes the same plan.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from jaxrl_llm.rollout.page_pool import PagePool, pages_for


@dataclasses.dataclass(eq=False)
class Row:
    """One response of a request."""

    rid: int  # index in the request (prompt-major: response j of prompt i is i * n + j)
    prompt: int  # which prompt it answers
    ids: list[int]  # the prompt's token ids
    max_tokens: int
    stream: int = 0  # seeds the row's random draws (the engine's `seeds`; its rid by default)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False
    shard: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    admitted: int = -1  # admission order (preemption takes the newest)
    preemptions: int = 0
    # Routing replay R3: [positions, L_moe, k] experts of each context position the engine ran (-1: not yet)
    routes: np.ndarray | None = None

    @property
    def context_len(self) -> int:
        """Tokens whose K/V the row needs before its next step: everything but the pending token."""
        return len(self.ids) + len(self.tokens) - 1

    @property
    def pending(self) -> int:
        return self.tokens[-1] if self.tokens else self.ids[-1]

    def context(self) -> list[int]:
        return self.ids + self.tokens


@dataclasses.dataclass
class PrefillTask:
    """Write the K/V of context[start:end] of `row` at positions start..end-1 of `pages`.

    `pages` are the row's pages at admission: a copy on write planned in the same round replaces the
    row's partial prompt page only after this prefill has filled it (the engine prefills, then copies).
    """

    row: Row
    start: int
    end: int
    pages: list[int]


@dataclasses.dataclass
class Plan:
    """What the engine runs before and during the next decode segment."""

    prefills: list[PrefillTask]  # in order: a later task may read pages an earlier one writes
    copies: list[tuple[int, int]]  # (source page, destination page), before the segment
    slots: list[list[Row | None]]  # per shard: the rows in slot order (None: an empty slot)
    seg: int  # decode steps this segment may run
    stop_free: int  # end the segment early once this many slots (of all shards) are free
    preempted: int  # rows preempted while planning


@dataclasses.dataclass
class _Prefix:
    """The pages holding a prompt's context (all but its last token), as its first sample wrote them."""

    shard: int
    pages: list[int]
    epochs: np.ndarray
    tokens: int


class Scheduler:
    """Plans segments over a `PagePool` for the rows of one request."""

    def __init__(self, pool: PagePool, rows: list[Row], *, max_num_seqs: int, max_seg: int,
                 watermark: float = 0.01, share_prompts: bool = True):
        self.pool, self.ps = pool, pool.page_size
        self.slot_cap = max(1, max_num_seqs // pool.shards)  # slots a shard decodes at most
        self.max_seg = max_seg
        self.watermark = max(1, int(watermark * pool.usable()))
        self.share_prompts = share_prompts
        self.waiting: deque[Row] = deque(rows)
        self.running: list[list[Row]] = [[] for _ in range(pool.shards)]
        self.prefixes: dict[int, _Prefix] = {}
        self._admitted = 0
        self.stats = dict(preemptions=0, admitted=0, prefill_tokens=0, shared_pages=0, copies=0)

    # ---- queries -----------------------------------------------------------------------------
    def done(self) -> bool:
        return not self.waiting and not any(self.running)

    def _valid_prefix(self, row: Row) -> _Prefix | None:
        pre = self.prefixes.get(row.prompt)
        if pre is None or not self.share_prompts:
            return None
        p = np.asarray(pre.pages, np.int64)
        if np.all(self.pool.refcount[p] > 0) and np.array_equal(self.pool.epoch[p], pre.epochs):
            return pre
        del self.prefixes[row.prompt]
        return None

    # ---- planning ----------------------------------------------------------------------------
    def plan(self) -> Plan:
        """Admits, grows and (if needed) preempts; returns what the next segment runs."""
        prefills, resumed = [], []
        preempted = 0
        self._admit(prefills, resumed)
        prefills += resumed  # a resumed row may read prompt pages a fresh row prefills this round
        copies, seg = [], self.max_seg
        for shard in range(self.pool.shards):
            while True:
                rows = self.running[shard]
                seg_s = self._fit(rows, shard)
                if seg_s > 0 or not rows:
                    break
                victim = max(rows, key=lambda r: r.admitted)
                if len(rows) == 1:
                    raise RuntimeError(f"row {victim.rid} cannot take one more step with the whole pool; the "
                                       "engine's up-front check should have refused this request")
                self._preempt(victim)
                prefills = [p for p in prefills if p.row is not victim]
                preempted += 1
            if rows:
                seg = min(seg, seg_s)
        for shard in range(self.pool.shards):
            copies += self._grow(self.running[shard], seg)
        slots = []
        for shard in range(self.pool.shards):
            rows = sorted(self.running[shard], key=lambda r: r.admitted)
            width = min(self.slot_cap, max(MIN_SLOTS, slot_bucket(len(rows)))) if rows else 1
            slots.append(rows + [None] * (width - len(rows)))
        width = max(len(s) for s in slots)
        slots = [s + [None] * (width - len(s)) for s in slots]
        total = width * len(slots)
        empty = sum(r is None for s in slots for r in s)
        if self.waiting:  # refill as soon as a few slots free up (or pages come back)
            stop_free = empty + max(1, total // 16)
        else:  # no one waits: stop once the live rows fit the next smaller bucket
            stop_free = total - len(slots) * slot_bucket_below(width) if width > MIN_SLOTS else total
            # (shards holding fewer rows than the widest start with more free slots: never stop before a step)
            stop_free = max(stop_free, empty + 1)
        self.stats["preemptions"] += preempted
        self.stats["copies"] += len(copies)
        return Plan(prefills, copies, slots, seg, stop_free, preempted)

    def _admit(self, fresh: list[PrefillTask], resumed: list[PrefillTask]) -> None:
        pool = self.pool
        while self.waiting:
            row = self.waiting[0]
            pre = self._valid_prefix(row)
            shard = self._pick_shard(pre)
            if shard is None:
                return
            ctx = row.context_len
            shared: list[int] = []
            if pre is not None and pre.shard == shard:
                # A fresh sibling shares every prompt page (the partial last one is copied before its first
                # write); a resumed one only the full pages, which nothing writes into again.
                n_shared = len(pre.pages) if not row.tokens else min(pre.tokens, ctx) // self.ps
                shared = pre.pages[:n_shared]
            covered = min(len(shared) * self.ps, ctx)
            new = pages_for(ctx, self.ps) - len(shared)
            reserve = self.watermark if self.running[shard] else 0
            # The page its first step writes: a new one when the context ends on a page boundary, a copy
            # when it writes into a shared partial prompt page, else one the row already holds.
            first = int(ctx % self.ps == 0 or len(shared) > ctx // self.ps)
            if pool.num_free(shard) - new < reserve + first:
                return
            self.waiting.popleft()
            pool.share(shared)
            row.pages = shared + pool.alloc(shard, new)
            row.shard, row.admitted = shard, self._admitted
            self._admitted += 1
            self.running[shard].append(row)
            self.stats["admitted"] += 1
            self.stats["shared_pages"] += len(shared)
            if covered < ctx:
                self.stats["prefill_tokens"] += ctx - covered
                (resumed if row.tokens else fresh).append(PrefillTask(row, covered, ctx, list(row.pages)))
            if not row.tokens and pre is None and self.share_prompts:
                n = pages_for(ctx, self.ps)
                self.prefixes[row.prompt] = _Prefix(shard, row.pages[:n], pool.epoch[row.pages[:n]].copy(), ctx)

    def _pick_shard(self, pre: _Prefix | None) -> int | None:
        """The shard a waiting row goes to: its prompt's pages' shard when it has a free slot, else the
        shard with a free slot and the most free pages; None when every shard's slots are taken."""
        open_ = [s for s in range(self.pool.shards) if len(self.running[s]) < self.slot_cap]
        if not open_:
            return None
        if pre is not None and pre.shard in open_:
            return pre.shard
        return max(open_, key=lambda s: (self.pool.num_free(s), -s))

    def _needs(self, rows: list[Row], seg: int) -> np.ndarray:
        """[seg] new pages the rows of one shard need to run 1..seg steps (copies on write included)."""
        if not rows:
            return np.zeros(seg, np.int64)
        pos = np.asarray([r.context_len for r in rows], np.int64)
        have = np.asarray([len(r.pages) for r in rows], np.int64)
        left = np.asarray([r.max_tokens - len(r.tokens) for r in rows], np.int64)
        cow = np.asarray([_first_write_shared(r, self.pool) for r in rows], np.int64)
        k = np.minimum(np.arange(1, seg + 1)[:, None], left[None, :])  # [seg, R] steps each row runs
        need = np.maximum(0, (pos[None, :] + k - 1) // self.ps + 1 - have[None, :]) + cow[None, :]
        return need.sum(axis=1)

    def _fit(self, rows: list[Row], shard: int) -> int:
        """The longest segment (<= max_seg) whose pages fit the shard's free pages; 0 if not even one step."""
        need = self._needs(rows, self.max_seg)
        fits = np.nonzero(need <= self.pool.num_free(shard))[0]
        return int(fits[-1]) + 1 if fits.size else 0

    def _grow(self, rows: list[Row], seg: int) -> list[tuple[int, int]]:
        copies = []
        for r in rows:
            if not r.pages:
                continue
            pos = r.context_len
            if _first_write_shared(r, self.pool):
                i = pos // self.ps
                (dst,) = self.pool.alloc(r.shard, 1)
                copies.append((r.pages[i], dst))
                self.pool.release([r.pages[i]])
                r.pages[i] = dst
            k = min(seg, r.max_tokens - len(r.tokens))
            extra = (pos + k - 1) // self.ps + 1 - len(r.pages)
            if extra > 0:
                r.pages += self.pool.alloc(r.shard, extra)
        for r in rows:  # a row admitted with an empty context (a one-token prompt) gets its first page here
            if not r.pages:
                r.pages = self.pool.alloc(r.shard, pages_for(min(seg, r.max_tokens), self.ps))
        return copies

    def _preempt(self, row: Row) -> None:
        self.running[row.shard].remove(row)
        self.pool.release(row.pages)
        row.pages, row.shard, row.admitted = [], -1, -1
        row.preemptions += 1
        self.waiting.appendleft(row)

    # ---- results -----------------------------------------------------------------------------
    def commit(self, rows: list[Row], tokens: np.ndarray, logps: np.ndarray, counts: np.ndarray,
               finished: np.ndarray) -> list[Row]:
        """Appends each running row's new tokens; frees the pages of rows that finished (returned)."""
        out = []
        for i, r in enumerate(rows):
            c = int(counts[i])
            r.tokens += tokens[i, :c].tolist()
            r.logps += logps[i, :c].tolist()
            if finished[i]:
                r.finished = True
                self.running[r.shard].remove(r)
                self.pool.release(r.pages)
                r.pages = []
                out.append(r)
        return out


# The smallest slot bucket: a decode step over 32 slots costs about what one over 1 does (the weights'
# reads dominate, and empty slots read no K/V), and every bucket below it would be one more program to compile.
MIN_SLOTS = 32


def _first_write_shared(row: Row, pool: PagePool) -> bool:
    """Whether the page the row's next step writes into is held by another row too."""
    i = row.context_len // pool.page_size
    return i < len(row.pages) and pool.refcount[row.pages[i]] > 1


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def slot_bucket(x: int) -> int:
    """The smallest bucket >= x: a power of two up to 64, else a multiple of a quarter of the power of two below."""
    if x <= 64:
        return _next_pow2(x)
    q = (1 << (x.bit_length() - 1)) // 4
    return -(-x // q) * q


def slot_bucket_below(width: int) -> int:
    """The largest bucket < width (width itself a bucket > 1)."""
    if width <= 64:
        return width // 2
    low = 1 << (width.bit_length() - 1)
    return width - (low // 8 if width == low else low // 4)
