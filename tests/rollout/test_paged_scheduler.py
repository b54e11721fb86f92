"""One shard's host side (rollout/page_pool.py, rollout/scheduler.py), with no model: page reference counts and
epochs, the memory budget, slot buckets, and the scheduler driven by a fake decode that checks, after every plan,
that pages cover what the segment writes, that reference counts match the rows holding each page, and that every
K/V a row reads was written for that row's own context."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.rollout import page_pool
from jaxrl_llm.rollout.page_pool import KvBudget, PagePool, kv_bytes_per_token, pages_for, size_pool
from jaxrl_llm.rollout.rows import ListSource, Row, RowStore
from jaxrl_llm.rollout.scheduler import Plan, Scheduler, slot_bucket, slot_bucket_below, slot_ladder


def fake_token(rid: int, t: int) -> int:
    """Token t of response rid in the fake decode (>= 100, so it never equals a prompt id below)."""
    return 100 + (rid * 7 + t) % 50


def make_rows(prompt_lens: list[int], n: int, max_tokens: list[int]) -> list[Row]:
    """Prompt i is [i * 1000 + 1, ..., i * 1000 + len]: distinct across prompts and from fake tokens."""
    store = RowStore(len(prompt_lens) * n, max(max_tokens), pad_id=0)
    return [Row(rid=i * n + j, prompt=i, ids=np.arange(i * 1000 + 1, i * 1000 + length + 1, dtype=np.int32),
                max_tokens=max_tokens[i * n + j], store=store)
            for i, length in enumerate(prompt_lens) for j in range(n)]


def make_scheduler(rows: list[Row], pool: PagePool, *, max_num_seqs: int, max_seg: int, share_prompts=True,
                   width: int | None = None) -> Scheduler:
    width = width or max(pages_for(len(r.ids) + r.max_tokens, pool.page_size) for r in rows)
    return Scheduler(pool, ListSource(rows), slot_cap=max_num_seqs, max_seg=max_seg, width=width,
                     share_prompts=share_prompts)


@dataclasses.dataclass
class FakeEngine:
    """Runs plans the way a shard does (prefills, then copies, then one decode segment), on a host model of the
    pool whose K/V of position p is the context token at p. Every read and write is checked."""

    sched: Scheduler
    rows: list[Row]
    kv: np.ndarray = None  # [P, ps] the token whose K/V each page slot holds (-1: never written)
    plans: int = 0

    def __post_init__(self):
        self.kv = np.full((self.sched.pool.num_pages, self.sched.pool.page_size), -1, np.int64)

    def run(self) -> None:
        while not self.sched.done():
            self.plans += 1
            assert self.plans < 10_000, "the scheduler does not converge"
            plan = self.sched.plan()
            check_invariants(self.sched, plan, self.rows)
            self._prefill(plan)
            src, dst = plan.copies
            self.kv[dst] = self.kv[src]
            if plan.live:
                self._segment(plan)
        check_finished(self.sched, self.rows)

    def _read(self, pages, upto: int, context, what: str) -> None:
        ps = self.sched.pool.page_size
        got = [int(self.kv[pages[p // ps], p % ps]) for p in range(upto)]
        assert got == list(context[:upto]), f"{what}: read K/V of {got}, expected {list(context[:upto])}"

    def _prefill(self, plan: Plan) -> None:
        ps = self.sched.pool.page_size
        for task in plan.prefills:
            ctx = task.row.context()
            self._read(task.pages, task.start, ctx, f"prefill of row {task.row.rid}")
            for p in range(task.start, task.end):
                self.kv[task.pages[p // ps], p % ps] = ctx[p]

    def _segment(self, plan: Plan) -> None:
        """decode_segment's loop: step while steps < seg, a slot is active and fewer than stop_free are free."""
        sched, ps = self.sched, self.sched.pool.page_size
        live = [sched.rows[i] for i in range(plan.live)]
        new = {r.rid: [] for r in live}
        active = {r.rid: True for r in live}
        step = 0
        while step < plan.seg and any(active.values()) and plan.slots - sum(active.values()) < plan.stop_free:
            for i, r in enumerate(live):
                if not active[r.rid]:
                    continue
                pages = sched.table[i, : sched.npages[i]]
                pos, ctx = r.context_len + len(new[r.rid]), list(r.context()) + new[r.rid]
                assert pos // ps < len(pages), f"row {r.rid} writes position {pos} past its pages {pages}"
                self.kv[pages[pos // ps], pos % ps] = ctx[-1]
                self._read(pages, pos + 1, ctx, f"decode of row {r.rid}")
                t = r.ntok + len(new[r.rid])
                new[r.rid].append(fake_token(r.rid, t))
                active[r.rid] = t + 1 < r.max_tokens
            step += 1
        assert step > 0, (f"a segment runs no step: {plan.slots - plan.live} of {plan.slots} slots are empty and "
                          f"stop_free is {plan.stop_free}")
        width = max(plan.seg, 1)
        tokens = np.zeros((plan.slots, width), np.int32)
        counts = np.zeros(plan.slots, np.int32)
        still = np.zeros(plan.slots, bool)
        for i, r in enumerate(live):
            tokens[i, : len(new[r.rid])] = new[r.rid]
            counts[i], still[i] = len(new[r.rid]), active[r.rid]
        sched.commit(tokens, np.zeros(tokens.shape, np.float32), counts, still)


def check_invariants(sched: Scheduler, plan: Plan, rows: list[Row]) -> None:
    pool, ps = sched.pool, sched.pool.page_size
    assert plan.live == sched.n <= sched.cap and plan.slots >= plan.live
    if plan.live:
        assert 1 <= plan.seg <= sched.max_seg
    held = np.zeros(pool.num_pages, np.int32)
    for i in range(sched.n):
        r = sched.rows[i]
        assert not r.finished and sched.gid[i] == r.rid
        assert (sched.ctx[i], sched.ntok[i], sched.last[i]) == (r.context_len, r.ntok, r.pending)
        pages = sched.table[i, : sched.npages[i]]
        assert len(set(pages.tolist())) == len(pages), f"row {r.rid} holds a page twice: {pages}"
        assert np.all(pages != pool.scratch) and not sched.table[i, sched.npages[i]:].any()
        steps = min(plan.seg, r.max_tokens - r.ntok)
        assert len(pages) >= pages_for(r.context_len + steps, ps), (
            f"row {r.rid}: {len(pages)} pages do not cover {r.context_len} + {steps} positions")
        assert len(pages) <= pages_for(len(r.ids) + r.max_tokens - 1, ps)  # the engine's table width
        held[pages] += 1
    assert all(sched.rows[i] is None and not sched.table[i].any() for i in range(sched.n, sched.cap))
    np.testing.assert_array_equal(pool.refcount, held, err_msg="a page's refcount differs from the rows holding it")
    free = pool._free[: pool.num_free()]
    assert len(set(free.tolist())) == len(free) and sorted(free.tolist()) == [
        p for p in range(1, pool.num_pages) if held[p] == 0]
    waiting = {r.rid for r in sched.waiting}
    running = {sched.rows[i].rid for i in range(sched.n)}
    assert waiting.isdisjoint(running)
    taken = {r.rid for r in rows} - {r.rid for g in sched.source.groups for r in g}
    assert waiting | running | {r.rid for r in rows if r.finished} == taken


def check_finished(sched: Scheduler, rows: list[Row]) -> None:
    for r in rows:
        assert r.finished
        assert r.tokens.tolist() == [fake_token(r.rid, t) for t in range(r.max_tokens)], f"row {r.rid}"
    pool = sched.pool
    assert pool.in_use() == 0 and not pool.refcount.any() and pool.num_free() == pool.usable()
    assert sched.stats["admitted"] == len(rows) + sched.stats["preemptions"]  # every preemption is readmitted once
    assert sum(r.preemptions for r in rows) == sched.stats["preemptions"]


def drive(prompt_lens, n, max_tokens, *, page_size, usable, max_num_seqs=64, max_seg=4,
          share_prompts=True) -> tuple[Scheduler, list[Row]]:
    rows = make_rows(prompt_lens, n, max_tokens)
    sched = make_scheduler(rows, PagePool(usable + 1, page_size), max_num_seqs=max_num_seqs, max_seg=max_seg,
                           share_prompts=share_prompts)
    FakeEngine(sched, rows).run()
    return sched, rows


# ---- the page pool ------------------------------------------------------------------------------


def test_pool_refcounts_free_list_and_epochs():
    pool = PagePool(6, page_size=4)
    assert pool.usable() == 5 and pool.num_free() == 5 and pool.scratch == 0
    a = pool.alloc(2)
    assert a.tolist() == [1, 2]  # lowest first, never the scratch page
    pool.share([1])
    pool.share([1])
    assert pool.refcount[1] == 3 and pool.in_use() == 2 and pool.num_free() == 3
    pool.release([1])
    pool.release([1])
    assert pool.refcount[1] == 1 and pool.epoch[1] == 0 and 1 not in pool._free[: pool.num_free()]  # still held
    pool.release([1, 2])
    assert pool.refcount[1] == pool.refcount[2] == 0 and pool.num_free() == 5
    assert pool.epoch[1] == pool.epoch[2] == 1  # freed: a stale reference is detectable
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([1])
    pool.refcount[1] = 0
    with pytest.raises(RuntimeError, match="shared after they were freed"):
        pool.share([2])
    again = pool.alloc(5)
    assert again.tolist() == [1, 2, 3, 4, 5]  # the lowest free pages, in order
    assert pool.epoch[1] == 1  # an epoch only moves when the page is freed, not when handed out
    with pytest.raises(RuntimeError, match="asked for 1 pages, 0 free"):
        pool.alloc(1)
    with pytest.raises(ValueError, match="no usable page"):
        PagePool(1, page_size=2)


def test_pool_release_of_many_pages_at_once_frees_each_once():
    pool = PagePool(10, page_size=2)
    a = pool.alloc(4)
    pool.share(a[:2])
    pool.release(np.concatenate([a, a[:2]]))  # one array: shared pages released twice, the rest once
    assert pool.num_free() == 9 and not pool.refcount.any() and np.all(pool.epoch[a] == 1)
    assert pool.alloc(9).tolist() == list(range(1, 10))


def test_pages_for_and_kv_bytes_per_token():
    assert [pages_for(t, 4) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert kv_bytes_per_token(num_layers=3, num_kv_heads=2, head_dim=16, itemsize=2) == 2 * 3 * 2 * 16 * 2


# ---- the memory budget ---------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1000, 999, 100])
def test_size_pool_from_explicit_bytes_is_a_floor(nbytes):
    budget = size_pool(page_bytes=100, workspace=10**12, gpu_memory_utilization=0.9, kv_cache_memory_bytes=nbytes,
                       unbounded_pages=7)
    assert budget == KvBudget(nbytes // 100, 100, "kv_cache_memory_bytes")
    assert budget.num_pages * budget.page_bytes <= nbytes  # a device never holds more than asked


def test_size_pool_without_device_statistics_is_unbounded():
    assert page_pool.device_memory() is None  # CPU keeps no allocator statistics
    budget = size_pool(page_bytes=100, workspace=0, gpu_memory_utilization=0.5, kv_cache_memory_bytes=None,
                       unbounded_pages=10)
    assert budget.source == "unbounded" and budget.num_pages == 10


def test_size_pool_from_the_memory_fraction(monkeypatch):
    monkeypatch.setattr(page_pool, "device_memory", lambda device=None: (10_000, 2_000, 2_500))
    budget = size_pool(page_bytes=300, workspace=1_000, gpu_memory_utilization=0.8, kv_cache_memory_bytes=None,
                       unbounded_pages=10)
    # 0.8 * 10000 - 2000 in use - 1000 workspace = 5000 bytes a device: 16 pages of 300
    assert budget == KvBudget(16, 300, "gpu_memory_utilization", 10_000, 2_000, 1_000)
    crowded = size_pool(page_bytes=300, workspace=1_000, gpu_memory_utilization=0.2, kv_cache_memory_bytes=None,
                        unbounded_pages=10)
    assert crowded.num_pages == 0  # more in use than the share allows: no pages (the engine refuses the request)
    monkeypatch.setattr(page_pool, "device_memory", lambda device=None: (2**40, 2**30, 0))
    a, b = (size_pool(page_bytes=2**20, workspace=w, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None,
                      unbounded_pages=10).num_pages for w in (0, 2**27))
    assert a == b == page_pool.round_pages(a) and a >= 0.99 * (0.9 * 2**40 - 2**30) / 2**20  # 128 MiB apart, one shape


def test_round_pages_keeps_the_leading_bits():
    assert [page_pool.round_pages(p) for p in (0, 1, 255, 256, 257, 90826, 90686)] == [0, 1, 255, 256, 256, 90624,
                                                                                         90624]


# ---- slot buckets --------------------------------------------------------------------------------


def test_slot_buckets_are_a_fixed_ladder_with_at_most_a_quarter_padding():
    ladder = sorted({slot_bucket(x) for x in range(1, 513)})
    assert ladder[:11] == [1, 2, 4, 8, 16, 32, 64, 80, 96, 112, 128]
    assert ladder[11:15] == [160, 192, 224, 256]
    for x in range(1, 513):
        b = slot_bucket(x)
        assert b >= x and (x <= 64 or (b - x) / b <= 0.25)
    for lo, hi in zip(ladder, ladder[1:]):
        assert slot_bucket_below(hi) == lo
    assert slot_ladder(1024) == [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896,
                                 1024]
    assert slot_ladder(100) == [32, 64, 80, 96, 100] and slot_ladder(3) == [3]


# ---- the scheduler -------------------------------------------------------------------------------


def test_unconstrained_run_admits_every_row_at_once():
    sched, rows = drive([5, 2, 11, 3], 1, [8, 8, 8, 8], page_size=4, usable=40, max_seg=16)
    assert sched.stats["preemptions"] == 0 and sched.stats["admitted"] == 4
    assert all(r.preemptions == 0 for r in rows)


def test_slots_cap_the_running_rows_and_the_rest_wait():
    """max_num_seqs is this shard's: 3 slots for 5 rows; the first segment runs 3 rows and the others wait,
    then refill the slots as rows finish."""
    rows = make_rows([4] * 5, 1, [6, 2, 6, 6, 6])
    sched = make_scheduler(rows, PagePool(64, 4), max_num_seqs=3, max_seg=8)
    eng = FakeEngine(sched, rows)
    plan = sched.plan()
    assert plan.live == 3 and plan.slots == 3 and len(sched.waiting) + len(sched.source.groups) == 2
    assert plan.stop_free == 0 + max(1, 3 // 16)  # rows wait: end the segment as soon as a slot frees up
    eng._prefill(plan)
    eng._segment(plan)
    assert sched.n == 2 and rows[1].finished  # row 1 (2 tokens) finished and freed its slot
    eng.run()


def test_tight_pool_preempts_the_newest_rows_and_recomputes_them():
    """A pool with one page more than the longest row needs: all but the oldest row are preempted (the oldest is
    never the newest running row, so it is never the victim), and every row still gets its exact tokens."""
    lens = [5, 2, 11, 3]
    need = pages_for(max(lens) + 8 - 1, 2)
    sched, rows = drive(lens, 1, [8] * 4, page_size=2, usable=need + 1, max_seg=4)
    assert [r.preemptions > 0 for r in rows] == [False, True, True, True]
    assert sched.stats["prefill_tokens"] > sum(n - 1 for n in lens)  # recompute: contexts prefilled again


def test_siblings_share_prompt_pages_and_copy_the_partial_one():
    """n = 3 of a 7-token prompt, pages of 4: the context (6 tokens) fills page 0 and half of page 1. Siblings
    share both; before their first write into page 1, all but the last holder copy it."""
    rows = make_rows([7], 3, [5, 5, 5])
    pool = PagePool(16, page_size=4)
    sched = make_scheduler(rows, pool, max_num_seqs=8, max_seg=4)
    plan = sched.plan()
    assert [t.row.ntok for t in plan.prefills] == [0] and plan.prefills[0].row is rows[0]
    assert (plan.prefills[0].start, plan.prefills[0].end) == (0, 6)
    first = plan.prefills[0].pages
    assert np.all(sched.table[:3, 0] == first[0]) and pool.refcount[first[0]] == 3
    src, dst = plan.copies
    assert len(src) == 2 and np.all(src == first[1])
    assert pool.refcount[first[1]] == 1 and len(set(sched.table[:3, 1].tolist())) == 3  # private partial pages
    assert sched.stats["shared_pages"] == 4 and sched.stats["copies"] == 2


def test_siblings_copy_nothing_when_the_context_ends_on_a_page_boundary():
    rows = make_rows([9], 3, [5, 5, 5])  # context of 8 tokens: two full pages of 4
    sched = make_scheduler(rows, PagePool(16, page_size=4), max_num_seqs=8, max_seg=4)
    plan = sched.plan()
    assert len(plan.copies[0]) == 0 and sched.stats["shared_pages"] == 4 and sched.stats["copies"] == 0
    assert np.all(sched.table[:3, :2] == sched.table[0, :2]) and len(set(sched.table[:3, 2].tolist())) == 3


def test_no_sharing_when_switched_off():
    sched, _ = drive([7, 4], 3, [5] * 6, page_size=4, usable=30, share_prompts=False)
    assert sched.stats["shared_pages"] == 0 and sched.stats["copies"] == 0
    assert sched.stats["prefill_tokens"] == 3 * (6 + 3)


def test_preempted_sibling_shares_only_full_prompt_pages_on_readmission():
    lens, n = [7, 3], 3
    need = pages_for(7 + 8 - 1, 2)
    sched, rows = drive(lens, n, [8] * 6, page_size=2, usable=need + 2, max_seg=2)
    assert sched.stats["preemptions"] > 0 and sched.stats["shared_pages"] > 0


def test_a_row_that_needs_the_whole_pool_is_admitted():
    """The engine accepts a pool with exactly pages_for(prompt + max_tokens - 1) usable pages. A 4-token prompt,
    one new token and pages of 2 need 2 pages: the context (3 tokens) takes both, and the first step writes into
    the second. Admission must not ask for a further page beyond what the row can ever use."""
    rows = make_rows([4], 1, [1])
    plan = make_scheduler(rows, PagePool(3, page_size=2), max_num_seqs=4, max_seg=4).plan()
    assert plan.live == 1, "the only row was not admitted"


def test_a_minimum_pool_runs_every_row():
    """A pool of exactly the longest row's pages: rows run (nearly) one at a time, preempted and resumed."""
    sched, _ = drive([5, 2, 11, 3], 1, [8] * 4, page_size=2, usable=pages_for(11 + 8 - 1, 2), max_seg=4)
    assert sched.stats["preemptions"] > 0


def test_a_segment_with_few_rows_still_runs_a_step():
    """One prompt with n = 2 in a bucket of 32 slots: nobody waits, so stop_free is "the live rows fit the next
    smaller bucket"; it must still be above the number of free slots at the start, or the segment runs no step
    (and the shard loops)."""
    rows = make_rows([5], 2, [4, 4])
    plan = make_scheduler(rows, PagePool(32, page_size=4), max_num_seqs=64, max_seg=8).plan()
    assert plan.live == 2 and plan.slots == 32
    assert plan.slots - plan.live < plan.stop_free


@st.composite
def workloads(draw):
    prompts = draw(st.integers(1, 4))
    n = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(1, 10), min_size=prompts, max_size=prompts))
    caps = draw(st.lists(st.integers(1, 10), min_size=prompts * n, max_size=prompts * n))
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    longest = max(lens[i // n] + caps[i] - 1 for i in range(prompts * n))
    usable = pages_for(longest, page_size) + draw(st.integers(0, 8))  # >= the engine's up-front minimum
    return dict(prompt_lens=lens, n=n, max_tokens=caps, page_size=page_size, usable=usable,
                max_num_seqs=draw(st.integers(1, 8)), max_seg=draw(st.integers(1, 8)),
                share_prompts=draw(st.booleans()))


@settings(max_examples=40, deadline=None, database=None)
@given(workloads())
def test_scheduler_invariants_hold_on_random_workloads(workload):
    """Any workload the engine accepts finishes with the exact tokens of a fake decode; pages cover every write,
    refcounts equal the rows holding each page, and every page is free at the end."""
    drive(**workload)
