"""One shard's scheduler: which rows decode, which wait, and which pages each one holds.

Each data-parallel shard of the paged engine runs its own scheduler over its own `PagePool`, as vLLM runs
one engine core per data-parallel rank. Rows reach it in prompt groups from a `RowSource` (the engine's
dealer, rollout/dealer.py; rows.py). Between decode segments the shard asks for a `Plan`:

1. **Admission** (continuous batching): waiting rows take free decode slots, up to `slot_cap`
   (`rollout.max_num_seqs`), while the pool has pages for their context and a small watermark stays free.
   The first sample of a prompt prefills it; its siblings share the prompt's pages (reference-counted) and
   prefill nothing. A preempted row shares the prompt's full pages when a sibling still holds them.
2. **Growth**: every running row gets the pages its next `seg` tokens write, before the segment runs, so
   nothing is allocated on the device. A row about to write into a page that others share gets a private
   copy first (copy on write). When the pages do not cover a full segment, the segment is shortened; when
   they do not cover one step, the newest rows are preempted (vLLM's recompute mode: their pages are freed
   and they wait again at the front of the queue, keeping the tokens they have; on readmission their prompt
   and tokens are prefilled again).
3. **Slots**: running rows sit in slots 0..n-1 in admission order, and a segment runs a bucket of slots
   (at least 32, then 64, then four steps per doubling: 80, 96, 112, 128, 160, ...), so its program comes
   from a fixed ladder of shapes, at most 25% of the slots are padding, and a batch whose rows finished
   runs smaller.

The running rows' state lives in per-slot numpy arrays (context length, tokens so far, budget, pending
token, stream, page count) and one block table [slots, W] that growth appends to. Growth, a segment's
inputs and its commit are array operations: no Python loop over rows on the hot path. Python touches a
row only when it is admitted, preempted or finishes.

A row's positions: its context is prompt + sampled tokens. All but the last context token are in its
pages; the last one ("pending") is fed by the next decode step, which writes its K/V at position `ctx`
and samples token `t` (= tokens sampled so far).

**State slots** (Qwen3.5's linear-attention layers, when the engine passes a `states` pool): a running row also
holds one state slot (its conv window and recurrent state in every linear layer), taken at admission and given
back when it finishes or is preempted; admission waits for a free one as for pages. A prompt's first sample,
when siblings are still to come, takes a *snapshot* slot too: its prefill writes the state after the prompt
there, and each sibling, sharing the prompt's pages, starts from a copy of it (`Plan.state_copies`, run after
the round's prefills). The snapshot goes back when the last sibling has taken its copy. A recurrent state
cannot be rewound to a shared page boundary, so a preempted row of such a model recomputes its whole context.

Pure host code, deterministic given the rows it is dealt: every process that drives a shard makes the
same plan.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from jaxrl_llm.rollout.page_pool import PagePool, pages_for
from jaxrl_llm.rollout.rows import Row, RowSource


@dataclasses.dataclass
class PrefillTask:
    """Write the K/V of context[start:end] of `row` at positions start..end-1 of `pages`.

    `pages` are the row's pages at admission: a copy on write planned in the same round replaces the
    row's partial prompt page only after this prefill has filled it (the engine prefills, then copies).
    `slot` is the row's state slot and `snap` the snapshot slot its final state also goes to (0: none).
    """

    row: Row
    start: int
    end: int
    pages: np.ndarray
    slot: int = 0
    snap: int = 0


@dataclasses.dataclass
class Plan:
    """What the shard runs before and during the next decode segment."""

    prefills: list[PrefillTask]  # in order: a later task may read pages an earlier one writes
    copies: tuple[np.ndarray, np.ndarray]  # (source pages, destination pages), before the segment
    live: int  # running rows, in slots 0..live-1
    slots: int  # the segment's slot bucket (>= live)
    seg: int  # decode steps this segment may run
    stop_free: int  # end the segment early once this many of its slots are free
    preempted: int  # rows preempted while planning
    state_copies: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int32), np.zeros(0, np.int32))  # after prefills


@dataclasses.dataclass
class _Prefix:
    """The pages holding a prompt's context (all but its last token), as its first sample wrote them, and (with
    state slots) the snapshot slot holding the state after it, for `siblings` more samples to copy."""

    pages: np.ndarray
    epochs: np.ndarray
    tokens: int
    snap: int = 0
    siblings: int = 0


# The smallest slot bucket: a decode step over 32 slots costs about what one over 1 does (the weights'
# reads dominate, and empty slots read no K/V), and every bucket below it would be one more program to compile.
MIN_SLOTS = 32


class Scheduler:
    """Plans one shard's segments over its `PagePool`.

    Args:
      pool: the shard's pages.
      source: where rows come from, a prompt group at a time.
      slot_cap: rows decoded together at most (`rollout.max_num_seqs`, per shard as in vLLM).
      max_seg: decode steps a segment runs at most.
      width: block-table width W (pages a row can hold: the engine's max_model_len).
      watermark: the share of the pool admission keeps free while rows run.
      share_prompts: the n samples of a prompt share its prompt pages.
      states: the shard's state slots (a model with linear-attention layers), or None.
    """

    def __init__(self, pool: PagePool, source: RowSource, *, slot_cap: int, max_seg: int, width: int,
                 watermark: float = 0.01, share_prompts: bool = True, states: PagePool | None = None):
        self.pool, self.ps = pool, pool.page_size
        self.states = states
        self.source = source
        self.cap, self.max_seg, self.width = max(1, slot_cap), max_seg, width
        self.watermark = max(1, int(watermark * pool.usable()))
        self.share_prompts = share_prompts
        self.waiting: deque[Row] = deque()
        self.prefixes: dict[int, _Prefix] = {}
        cap = self.cap
        self.rows = np.empty(cap, object)  # the Row in each slot
        self.gid = np.zeros(cap, np.int64)  # its index in the request
        self.ctx = np.zeros(cap, np.int64)  # positions whose K/V it holds
        self.ntok = np.zeros(cap, np.int64)  # tokens sampled
        self.maxtok = np.zeros(cap, np.int64)
        self.last = np.zeros(cap, np.int64)  # the pending token
        self.stream = np.zeros(cap, np.int64)
        self.keys = np.zeros((cap, 2), np.int32)  # each row's request's PRNG key data
        self.npages = np.zeros(cap, np.int64)
        self.table = np.zeros((cap, width), np.int32)  # pages; 0 (scratch) past npages
        self.slot = np.zeros(cap, np.int64)  # state slot (0: none)
        self.state_copies: list[tuple[int, int, Row]] = []  # this round's (snapshot, slot, row)
        self._snaps_to_free: list[int] = []  # snapshots last read by the previous round's copies
        self.n = 0
        self.stats = dict(preemptions=0, admitted=0, prefill_tokens=0, shared_pages=0, copies=0, state_copies=0)

    # ---- queries -----------------------------------------------------------------------------
    def done(self) -> bool:
        return self.n == 0 and not self.waiting and not self.source.pending()

    def more_waiting(self) -> bool:
        return bool(self.waiting) or self.source.pending()

    def _valid_prefix(self, row: Row) -> _Prefix | None:
        pre = self.prefixes.get(row.prompt)
        if pre is None or not self.share_prompts:
            return None
        if self.states is not None and row.ntok:
            return None  # a resumed row recomputes its recurrent state from position 0
        if np.all(self.pool.refcount[pre.pages] > 0) and np.array_equal(self.pool.epoch[pre.pages], pre.epochs):
            return pre
        self._drop_prefix(row.prompt)
        return None

    def _drop_prefix(self, prompt: int) -> None:
        pre = self.prefixes.pop(prompt)
        if pre.snap:
            self._snaps_to_free.append(pre.snap)

    # ---- planning ----------------------------------------------------------------------------
    def plan(self) -> Plan:
        """Admits, grows and (if needed) preempts; returns what the next segment runs."""
        prefills, resumed = [], []
        self.state_copies = []
        if self._snaps_to_free:  # the copies that read them ran after the last round's prefills
            self.states.release(self._snaps_to_free)
            self._snaps_to_free = []
        self._admit(prefills, resumed)
        prefills += resumed  # a resumed row may read prompt pages a fresh row prefills this round
        preempted = 0
        while True:
            seg = self._fit()
            if seg > 0 or self.n == 0:
                break
            if self.n == 1:
                raise RuntimeError(f"row {self.rows[0].rid} cannot take one more step with the whole pool; the "
                                   "engine's up-front check should have refused this request")
            victim = self._preempt_newest()
            prefills = [p for p in prefills if p.row is not victim]
            self.state_copies = [c for c in self.state_copies if c[2] is not victim]
            preempted += 1
        copies = self._grow(seg) if self.n else (np.zeros(0, np.int32), np.zeros(0, np.int32))
        n = self.n
        slots = slot_width(n, self.cap)
        if self.more_waiting():  # refill as soon as a few slots free up (or pages come back)
            stop_free = slots - n + max(1, slots // 16)
        else:  # no one waits: stop once the live rows fit the next smaller bucket
            stop_free = slots - slot_bucket_below(slots) if slots > MIN_SLOTS else slots
            stop_free = max(stop_free, slots - n + 1)
        self.stats["preemptions"] += preempted
        self.stats["copies"] += len(copies[0])
        state_copies = (np.asarray([c[0] for c in self.state_copies], np.int32),
                        np.asarray([c[1] for c in self.state_copies], np.int32))
        return Plan(prefills, copies, n, slots, seg, stop_free, preempted, state_copies)

    def _admit(self, fresh: list[PrefillTask], resumed: list[PrefillTask]) -> None:
        pool, ps = self.pool, self.ps
        while True:
            if self.n >= self.cap:
                self.source.full()
                return
            if not self.waiting:
                group = self.source.take(self._fits)
                if not group:
                    return
                self.waiting.extend(group)
            row = self.waiting[0]
            shared, covered, new = self._admission_pages(row)
            if not self._fits(row):
                return
            self.waiting.popleft()
            ctx = row.context_len
            pool.share(shared)
            pages = np.concatenate([shared, pool.alloc(new)]).astype(np.int32)
            slot = snap = siblings = 0
            if self.states is not None:
                slot = int(self.states.alloc(1)[0])
                if len(shared):  # a sibling: its state after the prompt is the snapshot's
                    pre = self.prefixes[row.prompt]
                    self.state_copies.append((pre.snap, slot, row))
                    self.stats["state_copies"] += 1
                    pre.siblings -= 1
                    if pre.siblings <= 0:  # the last one: the snapshot is free once this round's copies ran
                        self._release_snap_after_copy(row.prompt)
                else:
                    for r in self.waiting:  # its group's other fresh samples follow it in the queue
                        if r.prompt != row.prompt or r.ntok:
                            break
                        siblings += 1
                    # a snapshot only from slots the slot cap's other rows do not need
                    if (not row.ntok and siblings and self.share_prompts and row.prompt not in self.prefixes
                            and self.states.num_free() > self.cap - (self.n + 1)):
                        snap = int(self.states.alloc(1)[0])
            s = self.n
            self.n += 1
            self.rows[s], self.gid[s] = row, row.rid
            self.ctx[s], self.ntok[s], self.maxtok[s] = ctx, row.ntok, row.max_tokens
            self.last[s], self.stream[s], self.npages[s] = row.pending, row.stream, len(pages)
            self.keys[s] = row.key if row.key is not None else 0
            self.table[s] = 0
            self.table[s, : len(pages)] = pages
            self.slot[s] = slot
            self.stats["admitted"] += 1
            self.stats["shared_pages"] += len(shared)
            if covered < ctx:
                self.stats["prefill_tokens"] += ctx - covered
                (resumed if row.ntok else fresh).append(PrefillTask(row, covered, ctx, pages.copy(), slot, snap))
            if (not row.ntok and len(shared) == 0 and self.share_prompts and row.prompt not in self.prefixes
                    and (self.states is None or snap)):
                k = pages_for(ctx, ps)
                self.prefixes[row.prompt] = _Prefix(pages[:k].copy(), pool.epoch[pages[:k]].copy(), ctx, snap,
                                                    siblings)

    def _release_snap_after_copy(self, prompt: int) -> None:
        """The prompt's prefix is forgotten (a model with state slots shares a prompt only between its fresh
        samples) and its snapshot goes back to the pool at the next round, after this round's copies read it."""
        self._drop_prefix(prompt)

    def _admission_pages(self, row: Row) -> tuple[np.ndarray, int, int]:
        """(prompt pages it shares, context tokens they cover, new pages it needs) if admitted now."""
        pre = self._valid_prefix(row)
        ctx = row.context_len
        shared = np.zeros(0, np.int32)
        if pre is not None:
            # A fresh sibling shares every prompt page (the partial last one is copied before its first write);
            # a resumed one only the full pages, which nothing writes into again.
            k = len(pre.pages) if not row.ntok else min(pre.tokens, ctx) // self.ps
            shared = pre.pages[:k]
        covered = min(len(shared) * self.ps, ctx)
        return shared, covered, pages_for(ctx, self.ps) - len(shared)

    def _fits(self, row: Row) -> bool:
        """Whether the pool has the row's pages now (and keeps the watermark while other rows run), and a state
        slot where the model has linear layers."""
        if self.states is not None and self.states.num_free() < 1:
            return False
        shared, _, new = self._admission_pages(row)
        ctx = row.context_len
        reserve = self.watermark if self.n else 0
        # The page its first step writes: a new one when the context ends on a page boundary, a copy when it
        # writes into a shared partial prompt page, else one the row already holds.
        first = int(ctx % self.ps == 0 or len(shared) > ctx // self.ps)
        return self.pool.num_free() - new >= reserve + first

    def _cow(self) -> np.ndarray:
        """[n] bool: the live rows whose next write lands in a page others hold, and which copy it first. Of the
        rows writing into one shared page, all copy but the last when every holder of the page writes into it."""
        n, ps = self.n, self.ps
        idx = self.ctx[:n] // ps
        has = idx < self.npages[:n]
        page = self.table[np.arange(n), np.minimum(idx, self.width - 1)]
        cow = has & (self.pool.refcount[page] > 1)
        w = np.flatnonzero(cow)
        if w.size:
            uniq, inv, counts = np.unique(page[w], return_inverse=True, return_counts=True)
            last = np.full(uniq.size, -1, np.int64)
            np.maximum.at(last, inv, w)
            keeps = (w == last[inv]) & (counts == self.pool.refcount[uniq])[inv]
            cow[w[keeps]] = False
        return cow

    def _needs(self, seg: int, cow: np.ndarray) -> np.ndarray:
        """[seg] new pages the live rows need to run 1..seg steps (copies on write included)."""
        n = self.n
        left = self.maxtok[:n] - self.ntok[:n]
        k = np.minimum(np.arange(1, seg + 1)[:, None], left[None, :])  # [seg, n] steps each row runs
        need = np.maximum(0, (self.ctx[:n][None, :] + k - 1) // self.ps + 1 - self.npages[:n][None, :])
        return need.sum(axis=1) + int(cow.sum())

    def _fit(self) -> int:
        """The longest segment (<= max_seg) whose pages fit the free pages; 0 if not even one step."""
        if not self.n:
            return self.max_seg
        need = self._needs(self.max_seg, self._cow())
        fits = np.nonzero(need <= self.pool.num_free())[0]
        return int(fits[-1]) + 1 if fits.size else 0

    def _grow(self, seg: int) -> tuple[np.ndarray, np.ndarray]:
        """Gives every live row the pages its next `seg` steps write; returns the planned copies on write."""
        n, ps, pool = self.n, self.ps, self.pool
        cow = np.flatnonzero(self._cow())
        src = dst = np.zeros(0, np.int32)
        if cow.size:
            col = self.ctx[cow] // ps
            src = self.table[cow, col].copy()
            dst = pool.alloc(cow.size)
            pool.release(src)
            self.table[cow, col] = dst
        left = self.maxtok[:n] - self.ntok[:n]
        k = np.minimum(seg, left)
        extra = np.maximum(0, (self.ctx[:n] + k - 1) // ps + 1 - self.npages[:n])
        total = int(extra.sum())
        if total:
            pages = pool.alloc(total)
            rows = np.repeat(np.arange(n), extra)
            start = np.repeat(np.cumsum(extra) - extra, extra)
            self.table[rows, self.npages[rows] + np.arange(total) - start] = pages
            self.npages[:n] += extra
        return src, dst

    def _preempt_newest(self) -> Row:
        s = self.n - 1  # slots are in admission order
        row = self.rows[s]
        self.pool.release(self.table[s, : self.npages[s]])
        if self.slot[s]:
            self.states.release([self.slot[s]])
        self._clear(np.asarray([s]))
        self.n -= 1
        row.preemptions += 1
        self.waiting.appendleft(row)
        return row

    def preempt_all(self) -> int:
        """Sends every running row back to the front of the queue, in admission order, with its tokens: it is
        prefilled again at readmission (a partial rollout that recomputes its K/V after a weight swap)."""
        n = self.n
        while self.n:
            self._preempt_newest()
        self.stats["preemptions"] += n
        return n

    def _clear(self, slots: np.ndarray) -> None:
        self.rows[slots] = None
        self.table[slots] = 0
        self.npages[slots] = 0
        self.slot[slots] = 0

    # ---- results -----------------------------------------------------------------------------
    def commit(self, tokens: np.ndarray, logps: np.ndarray, counts: np.ndarray, active: np.ndarray,
               version: int = 0) -> list[Row]:
        """Appends each live row's new tokens ([slots, M] arrays from the segment, sampled by weights `version`;
        `active` false for rows that stopped), frees the pages of rows that finished and packs the rest into
        slots 0..; returns the finished."""
        n = self.n
        c = counts[:n].astype(np.int64)
        total = int(c.sum())
        store = self.rows[0].store if n else None
        if total:
            slot = np.repeat(np.arange(n), c)
            off = np.arange(total) - np.repeat(np.cumsum(c) - c, c)
            store.tokens[self.gid[slot], self.ntok[slot] + off] = tokens[slot, off]
            store.logps[self.gid[slot], self.ntok[slot] + off] = logps[slot, off]
            store.versions[self.gid[slot], self.ntok[slot] + off] = version
            ran = np.flatnonzero(c)
            self.last[ran] = tokens[ran, c[ran] - 1]
            self.ntok[:n] += c
            self.ctx[:n] += c
            store.lengths[self.gid[:n]] = self.ntok[:n]
        fin = np.flatnonzero(~active[:n].astype(bool))
        if not fin.size:
            return []
        held = np.arange(self.width)[None, :] < self.npages[fin][:, None]
        self.pool.release(self.table[fin][held])
        if self.states is not None:
            self.states.release(self.slot[fin][self.slot[fin] > 0])
        done = list(self.rows[fin])
        for r in done:
            r.finished = True
        keep = np.flatnonzero(active[:n].astype(bool))
        m = keep.size
        for arr in (self.rows, self.gid, self.ctx, self.ntok, self.maxtok, self.last, self.stream, self.keys,
                    self.npages, self.table, self.slot):
            arr[:m] = arr[keep]
        self._clear(np.arange(m, n))
        self.n = m
        return done


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def slot_bucket(x: int) -> int:
    """The smallest bucket >= x: a power of two up to 64, else a multiple of a quarter of the power of two below."""
    if x <= 64:
        return _next_pow2(x)
    q = (1 << (x.bit_length() - 1)) // 4
    return -(-x // q) * q


def slot_width(n: int, cap: int) -> int:
    """The decode width (slots) of a segment with `n` live rows on a shard of `cap` slots: never under
    MIN_SLOTS (nor over the cap), so a shard of few rows still runs the narrowest program built ahead."""
    return min(cap, max(MIN_SLOTS, slot_bucket(n))) if n else 1


def slot_bucket_below(width: int) -> int:
    """The largest bucket < width (width itself a bucket > 1)."""
    if width <= 64:
        return width // 2
    low = 1 << (width.bit_length() - 1)
    return width - (low // 8 if width == low else low // 4)


def slot_ladder(cap: int) -> list[int]:
    """Every slot bucket a shard of `cap` slots can run (the decode programs it may need)."""
    out, x = [], 1
    while True:
        b = min(cap, max(MIN_SLOTS, slot_bucket(x)))
        if not out or b != out[-1]:
            out.append(b)
        if b >= cap:
            return out
        x = b + 1
