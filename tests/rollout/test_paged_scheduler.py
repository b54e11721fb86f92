"""The paged sampler's host side (rollout/page_pool.py, rollout/scheduler.py), with no model: page reference
counts and epochs, the memory budget, slot buckets, and the scheduler driven by a fake decode that checks,
after every plan, that pages cover what the segment writes, that reference counts match the rows holding
each page, and that every K/V a row reads was written for that row's own context."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.rollout import page_pool
from jaxrl_llm.rollout.page_pool import KvBudget, PagePool, kv_bytes_per_token, pages_for, size_pool
from jaxrl_llm.rollout.scheduler import Plan, Row, Scheduler, slot_bucket, slot_bucket_below


def fake_token(rid: int, t: int) -> int:
    """Token t of response rid in the fake decode (>= 100, so it never equals a prompt id below)."""
    return 100 + (rid * 7 + t) % 50


def make_rows(prompt_lens: list[int], n: int, max_tokens: list[int]) -> list[Row]:
    """Prompt i is [i * 1000 + 1, ..., i * 1000 + len]: distinct across prompts and from fake tokens."""
    return [Row(rid=i * n + j, prompt=i, ids=[i * 1000 + k + 1 for k in range(length)],
                max_tokens=max_tokens[i * n + j]) for i, length in enumerate(prompt_lens) for j in range(n)]


@dataclasses.dataclass
class FakeEngine:
    """Runs plans the way JaxEngine does (prefills, then copies, then one decode segment), on a host model of
    the pool whose K/V of position p is the context token at p. Every read and write is checked."""

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
            for src, dst in plan.copies:
                self.kv[dst] = self.kv[src]
            self._segment(plan)
        check_finished(self.sched, self.rows)

    def _read(self, pages: list[int], upto: int, context: list[int], what: str) -> None:
        ps = self.sched.pool.page_size
        got = [int(self.kv[pages[p // ps], p % ps]) for p in range(upto)]
        assert got == context[:upto], f"{what}: read K/V of {got}, expected {context[:upto]}"

    def _prefill(self, plan: Plan) -> None:
        ps = self.sched.pool.page_size
        for task in plan.prefills:
            ctx = task.row.context()
            self._read(task.pages, task.start, ctx, f"prefill of row {task.row.rid}")
            for p in range(task.start, task.end):
                self.kv[task.pages[p // ps], p % ps] = ctx[p]

    def _segment(self, plan: Plan) -> None:
        """decode_segment's loop: step while steps < seg, a slot is active and fewer than stop_free are free."""
        ps = self.sched.pool.page_size
        slots = [r for shard in plan.slots for r in shard]
        live = [r for r in slots if r is not None]
        waiting = [r.context_len for r in self.sched.waiting]
        assert live, (f"the plan decodes no row while {len(waiting)} wait (contexts {waiting}, "
                      f"{self.sched.pool.usable()} usable pages of {ps})")
        new = {r.rid: [] for r in live}
        active = {r.rid: True for r in live}
        step = 0
        while step < plan.seg and any(active.values()) and len(slots) - sum(active.values()) < plan.stop_free:
            for r in live:
                if not active[r.rid]:
                    continue
                pos, ctx = r.context_len + len(new[r.rid]), r.context() + new[r.rid]
                assert pos // ps < len(r.pages), f"row {r.rid} writes position {pos} past its pages {r.pages}"
                self.kv[r.pages[pos // ps], pos % ps] = ctx[-1]
                self._read(r.pages, pos + 1, ctx, f"decode of row {r.rid}")
                t = len(r.tokens) + len(new[r.rid])
                new[r.rid].append(fake_token(r.rid, t))
                active[r.rid] = t + 1 < r.max_tokens
            step += 1
        assert step > 0, (f"a segment runs no step: {len(slots) - len(live)} of {len(slots)} slots are empty and "
                          f"stop_free is {plan.stop_free} (rows per shard {[len(s) for s in self.sched.running]})")
        width = max(plan.seg, 1)
        tokens = np.zeros((len(live), width), np.int32)
        for i, r in enumerate(live):
            tokens[i, : len(new[r.rid])] = new[r.rid]
        self.sched.commit(live, tokens, np.zeros(tokens.shape, np.float32),
                          np.asarray([len(new[r.rid]) for r in live]), np.asarray([not active[r.rid] for r in live]))


def check_invariants(sched: Scheduler, plan: Plan, rows: list[Row]) -> None:
    pool, ps = sched.pool, sched.pool.page_size
    assert 1 <= plan.seg <= sched.max_seg
    held = np.zeros(pool.num_pages, np.int32)
    for shard, running in enumerate(sched.running):
        assert len(running) <= sched.slot_cap
        assert sorted(r.rid for r in running) == sorted(r.rid for r in plan.slots[shard] if r is not None)
        for r in running:
            assert r.shard == shard and not r.finished
            assert len(set(r.pages)) == len(r.pages), f"row {r.rid} holds a page twice: {r.pages}"
            assert all(pool.shard_of(p) == shard and p != pool.scratch(shard) for p in r.pages), (
                f"row {r.rid} of shard {shard} holds pages {r.pages} outside its range or the scratch page")
            steps = min(plan.seg, r.max_tokens - len(r.tokens))
            assert len(r.pages) >= pages_for(r.context_len + steps, ps), (
                f"row {r.rid}: {len(r.pages)} pages do not cover {r.context_len} + {steps} positions")
            assert len(r.pages) <= pages_for(len(r.ids) + r.max_tokens - 1, ps)  # the engine's table width
            held[r.pages] += 1
    np.testing.assert_array_equal(pool.refcount, held, err_msg="a page's refcount differs from the rows holding it")
    for shard in range(pool.shards):
        lo, hi = shard * pool.per_shard, (shard + 1) * pool.per_shard
        free = pool._free[shard]
        assert len(set(free)) == len(free) and all(lo < p < hi for p in free)
        assert sorted(free) == [p for p in range(lo + 1, hi) if held[p] == 0]
        assert pool.num_free(shard) + int((held[lo:hi] > 0).sum()) == pool.usable()
    waiting = {r.rid for r in sched.waiting}
    assert all(not r.pages and r.shard == -1 for r in sched.waiting)
    running = {r.rid for s in sched.running for r in s}
    assert waiting.isdisjoint(running)
    assert waiting | running | {r.rid for r in rows if r.finished} == {r.rid for r in rows}


def check_finished(sched: Scheduler, rows: list[Row]) -> None:
    for r in rows:
        assert r.finished and not r.pages
        assert r.tokens == [fake_token(r.rid, t) for t in range(r.max_tokens)], f"row {r.rid}"
    pool = sched.pool
    assert pool.in_use() == 0 and not pool.refcount.any()
    assert all(pool.num_free(s) == pool.usable() for s in range(pool.shards))
    assert sched.stats["admitted"] == len(rows) + sched.stats["preemptions"]  # every preemption is readmitted once
    assert sum(r.preemptions for r in rows) == sched.stats["preemptions"]


def drive(prompt_lens, n, max_tokens, *, page_size, usable, shards=1, max_num_seqs=64, max_seg=4,
          share_prompts=True) -> tuple[Scheduler, list[Row]]:
    rows = make_rows(prompt_lens, n, max_tokens)
    pool = PagePool((usable + 1) * shards, page_size, shards)
    sched = Scheduler(pool, rows, max_num_seqs=max_num_seqs, max_seg=max_seg, share_prompts=share_prompts)
    FakeEngine(sched, rows).run()
    return sched, rows


# ---- the page pool ------------------------------------------------------------------------------


def test_pool_refcounts_free_list_and_epochs():
    pool = PagePool(6, page_size=4)
    assert pool.usable() == 5 and pool.num_free() == 5 and pool.scratch() == 0
    a = pool.alloc(0, 2)
    assert a == [1, 2]  # lowest first, never the scratch page
    pool.share([1])
    pool.share([1])
    assert pool.refcount[1] == 3 and pool.in_use() == 2 and pool.num_free() == 3
    pool.release([1])
    pool.release([1])
    assert pool.refcount[1] == 1 and pool.epoch[1] == 0 and 1 not in pool._free[0]  # still held by one
    pool.release([1, 2])
    assert pool.refcount[1] == pool.refcount[2] == 0 and pool.num_free() == 5
    assert pool.epoch[1] == pool.epoch[2] == 1  # freed: a stale reference is detectable
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([1])
    with pytest.raises(RuntimeError, match="shared after it was freed"):
        pool.share([2])
    again = pool.alloc(0, 5)
    assert sorted(again) == [1, 2, 3, 4, 5]
    assert pool.epoch[1] == 1  # an epoch only moves when the page is freed, not when handed out
    with pytest.raises(RuntimeError, match="asked for 1 pages, 0 free"):
        pool.alloc(0, 1)


def test_pool_shards_own_equal_page_ranges_with_a_scratch_page_each():
    pool = PagePool(12, page_size=2, shards=3)
    assert pool.per_shard == 4 and pool.usable() == 3
    assert [pool.scratch(s) for s in range(3)] == [0, 4, 8]
    for s in range(3):
        pages = pool.alloc(s, 3)
        assert all(pool.shard_of(p) == s and p != pool.scratch(s) for p in pages)
        assert pool.num_free(s) == 0
    with pytest.raises(ValueError, match="split evenly"):
        PagePool(10, page_size=2, shards=3)
    with pytest.raises(ValueError, match="no usable page"):
        PagePool(4, page_size=2, shards=4)


def test_pages_for_and_kv_bytes_per_token():
    assert [pages_for(t, 4) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert kv_bytes_per_token(num_layers=3, num_kv_heads=2, head_dim=16, itemsize=2) == 2 * 3 * 2 * 16 * 2


# ---- the memory budget ---------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes,shards", [(1000, 1), (1000, 4), (999, 2), (100, 1)])
def test_size_pool_from_explicit_bytes_is_floor_per_shard(nbytes, shards):
    budget = size_pool(page_bytes=100, shards=shards, workspace=10**12, gpu_memory_utilization=0.9,
                       kv_cache_memory_bytes=nbytes, unbounded_pages=7)
    assert budget == KvBudget(nbytes // 100 * shards, 100, "kv_cache_memory_bytes")
    assert budget.num_pages // shards * budget.page_bytes <= nbytes  # a device never holds more than asked


def test_size_pool_without_device_statistics_is_unbounded():
    assert page_pool.device_memory() is None  # CPU keeps no allocator statistics
    budget = size_pool(page_bytes=100, shards=4, workspace=0, gpu_memory_utilization=0.5,
                       kv_cache_memory_bytes=None, unbounded_pages=10)
    assert budget.source == "unbounded" and budget.num_pages == 12  # 3 a shard: rounded up to split evenly


def test_size_pool_from_the_memory_fraction(monkeypatch):
    monkeypatch.setattr(page_pool, "device_memory", lambda device=None: (10_000, 2_000, 2_500))
    budget = size_pool(page_bytes=300, shards=2, workspace=1_000, gpu_memory_utilization=0.8,
                       kv_cache_memory_bytes=None, unbounded_pages=10)
    # 0.8 * 10000 - 2000 in use - 1000 workspace = 5000 bytes a device: 16 pages of 300
    assert budget == KvBudget(32, 300, "gpu_memory_utilization", 10_000, 2_000, 1_000)
    crowded = size_pool(page_bytes=300, shards=2, workspace=1_000, gpu_memory_utilization=0.2,
                        kv_cache_memory_bytes=None, unbounded_pages=10)
    assert crowded.num_pages == 0  # more in use than the share allows: no pages (the engine refuses the request)


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


# ---- the scheduler -------------------------------------------------------------------------------


def test_unconstrained_run_admits_every_row_at_once():
    sched, rows = drive([5, 2, 11, 3], 1, [8, 8, 8, 8], page_size=4, usable=40, max_seg=16)
    assert sched.stats["preemptions"] == 0 and sched.stats["admitted"] == 4
    assert all(r.preemptions == 0 for r in rows)


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
    sched = Scheduler(pool, rows, max_num_seqs=8, max_seg=4)
    plan = sched.plan()
    assert [len(t.row.tokens) for t in plan.prefills] == [0] and plan.prefills[0].row is rows[0]
    assert (plan.prefills[0].start, plan.prefills[0].end) == (0, 6)
    first = plan.prefills[0].pages
    assert all(r.pages[0] == first[0] for r in rows) and pool.refcount[first[0]] == 3
    assert len(plan.copies) == 2 and all(src == first[1] for src, _ in plan.copies)
    assert pool.refcount[first[1]] == 1 and len({r.pages[1] for r in rows}) == 3  # private partial pages now
    assert sched.stats["shared_pages"] == 4 and sched.stats["copies"] == 2


def test_siblings_copy_nothing_when_the_context_ends_on_a_page_boundary():
    rows = make_rows([9], 3, [5, 5, 5])  # context of 8 tokens: two full pages of 4
    pool = PagePool(16, page_size=4)
    sched = Scheduler(pool, rows, max_num_seqs=8, max_seg=4)
    plan = sched.plan()
    assert plan.copies == [] and sched.stats["shared_pages"] == 4 and sched.stats["copies"] == 0
    assert all(r.pages[:2] == rows[0].pages[:2] for r in rows) and len({r.pages[2] for r in rows}) == 3


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
    pool = PagePool(3, page_size=2)  # 2 usable
    plan = Scheduler(pool, rows, max_num_seqs=4, max_seg=4).plan()
    assert [r.rid for s in plan.slots for r in s if r is not None] == [0], "the only row was not admitted"


def test_a_minimum_pool_runs_every_row():
    """A pool of exactly the longest row's pages: rows run (nearly) one at a time, preempted and resumed."""
    sched, _ = drive([5, 2, 11, 3], 1, [8] * 4, page_size=2, usable=pages_for(11 + 8 - 1, 2), max_seg=4)
    assert sched.stats["preemptions"] > 0


def test_a_segment_runs_when_the_live_rows_sit_on_one_data_shard():
    """4 data-parallel shards, one prompt with n = 2: both rows share the prompt's pages on shard 0, the other
    shards' slots are empty. Nobody waits, so stop_free is "the live rows fit the next smaller bucket"; it must
    still be above the number of free slots at the start, or the segment runs no step (and the engine loops)."""
    rows = make_rows([5], 2, [4, 4])
    pool = PagePool(4 * 8, page_size=4, shards=4)
    plan = Scheduler(pool, rows, max_num_seqs=16, max_seg=8).plan()
    free = sum(r is None for shard in plan.slots for r in shard)
    assert [sum(r is not None for r in s) for s in plan.slots] == [2, 0, 0, 0]
    assert free < plan.stop_free, f"{free} of {sum(map(len, plan.slots))} slots are free at the start and " \
                                  f"stop_free is {plan.stop_free}: the decode loop's condition is false before step 0"


@st.composite
def workloads(draw):
    prompts = draw(st.integers(1, 4))
    n = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(1, 10), min_size=prompts, max_size=prompts))
    caps = draw(st.lists(st.integers(1, 10), min_size=prompts * n, max_size=prompts * n))
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    shards = draw(st.sampled_from([1, 2, 4]))
    longest = max(lens[i // n] + caps[i] - 1 for i in range(prompts * n))
    usable = pages_for(longest, page_size) + draw(st.integers(0, 8))  # >= the engine's up-front minimum
    return dict(prompt_lens=lens, n=n, max_tokens=caps, page_size=page_size, usable=usable, shards=shards,
                max_num_seqs=draw(st.integers(1, 8)) * shards, max_seg=draw(st.integers(1, 8)),
                share_prompts=draw(st.booleans()))


@settings(max_examples=25, deadline=None, database=None)
@given(workloads())
def test_scheduler_invariants_hold_on_random_workloads(workload):
    """Any workload the engine accepts finishes with the exact tokens of a fake decode; pages cover every write,
    refcounts equal the rows holding each page, no page leaves its shard, and every page is free at the end."""
    drive(**workload)
