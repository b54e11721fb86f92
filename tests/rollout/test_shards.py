"""Each data-parallel shard of the paged engine is an engine of its own (rollout/shard.py): the deal of prompt groups
and stealing (rollout/dealer.py), the program ladders (rollout/ladders.py), an executable moved to other devices
(rollout/programs.py), and on 4 simulated devices: each shard runs its own share of uneven work as one device would
alone, `max_num_seqs` per shard, and nothing compiled after the first calls, however prompts and budgets change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import compile_watch, sharding
from jaxrl_llm.rollout import JaxEngine, SamplingParams
from jaxrl_llm.rollout import shard as shard_mod
from jaxrl_llm.rollout.dealer import Dealer, deal
from jaxrl_llm.rollout.ladders import ATTN_BYTES, MIN_COPY, Ladders
from jaxrl_llm.rollout.programs import _load_on
from jaxrl_llm.rollout.rows import Row, RowStore
from jaxrl_llm.rollout.scheduler import PrefillTask


def rows_of(prompt_lens: list[int], n: int, budget) -> list[list[Row]]:
    store = RowStore(len(prompt_lens) * n, 64, 0)
    return [[Row(rid=i * n + j, prompt=i, ids=np.ones(length, np.int32), max_tokens=budget(i, j), store=store)
             for j in range(n)] for i, length in enumerate(prompt_lens)]


# ---- the deal and stealing ----------------------------------------------------------------------------------


def test_deal_keeps_groups_whole_and_evens_the_work():
    groups = rows_of([5, 30, 7, 12, 3, 20, 9, 4], 3, lambda i, j: 10 + i)
    dealt = deal(groups, 3)
    assert sorted(id(g) for q in dealt for g in q) == sorted(id(g) for g in groups)  # every group once, whole
    load = [sum(len(r.ids) + r.max_tokens for g in q for r in g) for q in dealt]
    biggest = max(sum(len(r.ids) + r.max_tokens for r in g) for g in groups)
    assert max(load) - min(load) <= biggest  # longest-processing-time first: within one group of even
    for q in dealt:  # each shard's own groups come largest first
        cost = [sum(len(r.ids) + r.max_tokens for r in g) for g in q]
        assert cost == sorted(cost, reverse=True)
    assert deal(groups, 3) == dealt  # a pure function: every process deals the same


def test_a_shard_takes_another_shards_group_only_when_that_shard_cannot_admit_it():
    groups = rows_of([4, 4, 4, 4], 1, lambda i, j: 8)
    dealer = Dealer([groups[:1], groups[1:]], [0, 1], steal=True)
    a, b = dealer.source(0), dealer.source(1)
    yes = lambda row: True
    assert a.take(yes) is groups[0] and a.take(yes) is None  # its own are gone; shard 1 is not blocked yet
    assert a.pending() is False and b.pending() is True
    assert b.take(yes) is groups[1]
    b.full()  # shard 1's slots are taken: its next groups wait
    assert a.pending() is True
    assert a.take(lambda row: False) is None  # a group a shard cannot fit stays where it is
    assert a.take(yes) is groups[3] and dealer.stolen == 1  # from the back of the blocked shard's queue
    assert b.take(lambda row: False) is None and dealer.blocked[1]  # its own group does not fit: blocked
    assert a.take(yes) is groups[2] and not b.pending() and dealer.stolen == 2
    no_steal = Dealer([groups[:1], groups[1:]], [0, 1], steal=False)
    no_steal.source(1).full()
    assert no_steal.source(0).take(yes) is groups[0] and no_steal.source(0).take(yes) is None
    assert not no_steal.source(0).pending()


# ---- the program ladders ------------------------------------------------------------------------------------


def test_ladders_are_fixed_by_config_and_cover_every_prefill():
    lad = Ladders(width=128, page_size=16, num_heads=28, max_batched_tokens=8192, max_prompt=512, slot_cap=1024)
    assert lad.fresh_lengths(512) == [16, 32, 64, 128, 256, 512] and lad.max_fresh == 2048
    for length in lad.fresh_lengths() + lad.cont_lengths:
        for fresh in (True, False):
            for b in lad.row_options(length, fresh):
                ctx = length if fresh else lad.width * lad.page_size
                assert b * length <= 8192 and b * length * ctx * 28 * 4 <= max(ATTN_BYTES, length * ctx * 28 * 4)
    store = RowStore(4, 8, 0)
    long_row = Row(0, 0, np.ones(3000, np.int32), 8, store)
    tasks = [PrefillTask(long_row, 0, 2999, np.zeros(0)), PrefillTask(Row(1, 1, np.ones(40, np.int32), 8, store), 0,
                                                                        39, np.zeros(0))]
    store.lengths[2] = 5  # a resumed row: its context after 16 shared prompt tokens
    tasks.append(PrefillTask(Row(2, 2, np.ones(20, np.int32), 8, store), 16, 24, np.zeros(0)))
    calls = lad.calls(tasks)
    covered = {}
    for call in calls:
        assert len({(c.length, c.fresh) for c in call}) == 1  # one program a call
        for c in call:
            assert c.end - c.start <= c.length
            covered.setdefault(c.task.row.rid, []).append((c.start, c.end))
    assert covered[0][0] == (0, 512) and covered[1] == [(0, 39)] and covered[2] == [(16, 24)]
    assert all(a[1] == b[0] for a, b in zip(covered[0], covered[0][1:])) and covered[0][-1][1] == 2999
    first_resumed = min(i for i, call in enumerate(calls) if call[0].task.row.rid == 2)
    assert all(c.task.row.ntok == 0 for call in calls[:first_resumed] for c in call)  # fresh rows first


def test_copy_widths_are_one_for_pages_only_and_a_ladder_with_state_slots():
    """A page pair is a few KB a layer: one copy program, the slot cap's power of two. A state pair is 24 MiB at
    Qwen3.5-9B: powers of two from the floor, and a round takes the narrowest that covers its pairs."""
    kw = dict(width=64, page_size=16, num_heads=28, max_batched_tokens=8192, max_prompt=300)
    assert Ladders(**kw, slot_cap=565).copy_widths == [1024]
    lad = Ladders(**kw, slot_cap=565, copy_floor=MIN_COPY)
    assert lad.copy_widths == [16, 32, 64, 128, 256, 512, 1024]
    assert [lad.copy_width(n) for n in (0, 1, 16, 17, 452, 565)] == [16, 16, 16, 32, 512, 1024]
    assert Ladders(**kw, slot_cap=3, copy_floor=MIN_COPY).copy_widths == [16]


def test_every_prefill_of_any_context_runs_on_a_program_built_ahead():
    """A recomputed partial rollout (fully async, after a weight swap) or a preempted row whose prompt pages are
    gone prefills its whole context from position 0: up to prompt + response, past the longest prompt. Its
    chunks still take only the shapes the engine builds ahead (fresh up to the prompt's, then continuation), so
    nothing compiles mid-run."""
    lad = Ladders(width=64, page_size=16, num_heads=28, max_batched_tokens=8192, max_prompt=300, slot_cap=256)
    built = {(n, True, b) for n in lad.fresh_lengths(300) for b in lad.row_options(n, True)}
    built |= {(n, False, b) for n in lad.cont_lengths for b in lad.row_options(n, False)}
    assert lad.fresh_lengths(300)[-1] == 512 < lad.max_fresh
    store = RowStore(64, 1024, 0)
    tasks = []
    for rid, (start, end) in enumerate([(0, 40), (0, 299), (0, 513), (0, 700), (0, 1023), (16, 1000), (256, 900)]):
        store.lengths[rid] = max(0, end - 300)  # the tokens it has past a 300-token prompt
        tasks.append(PrefillTask(Row(rid, rid, np.ones(min(end, 300), np.int32), 8, store), start, end, np.zeros(0)))
    seen = {rid: [] for rid in range(len(tasks))}
    for call in lad.calls(tasks):
        (length, fresh), rows = {(c.length, c.fresh) for c in call}.pop(), len(call)
        assert (length, fresh, rows) in built or any(
            (length, fresh, b) in built and rows <= b for b in lad.row_options(length, fresh)), (length, fresh, rows)
        for c in call:
            seen[c.task.row.rid].append((c.start, c.end))
    for rid, t in enumerate(tasks):  # every context covered once, in order
        spans = seen[rid]
        assert spans[0][0] == t.start and spans[-1][1] == t.end
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


# ---- one executable on other devices ------------------------------------------------------------------------


def test_an_executable_moved_to_another_device_runs_there_with_the_same_result():
    devices = jax.devices()[:2]
    f = jax.jit(lambda w, x: (jnp.tanh(x @ w).sum(0), x * 2), donate_argnums=(1,))
    w, x = np.random.default_rng(0).normal(size=(2, 16, 16)).astype(np.float32)
    compiled = f.lower(jax.device_put(w, devices[0]), jax.device_put(x, devices[0])).compile()
    before = compile_watch.totals()["compiles"]
    moved = _load_on(compiled, devices[:1], devices[1:])
    out = moved(jax.device_put(w, devices[1]), jax.device_put(x, devices[1]))
    assert compile_watch.totals()["compiles"] == before  # loaded, not compiled
    assert out[0].devices() == {devices[1]}
    np.testing.assert_allclose(out[0], np.tanh(x @ w).sum(0), rtol=1e-5)


# ---- the engine on 4 shards ---------------------------------------------------------------------------------


def _prompts(rng, count: int, lo: int = 2, hi: int = 12) -> list[list[int]]:
    return [rng.integers(10, 90, size=int(rng.integers(lo, hi))).tolist() for _ in range(count)]


def test_each_shard_runs_its_own_uneven_share_as_one_device_would_alone(model):
    """Four shards, stealing on, and uneven work: the deal gives two shards the long groups and two the short.
    Each shard runs as an engine of its own: its segment count and its rows' tokens are those of one device given
    only that shard's groups (same row streams), so the short shards stop early. A lockstep scheduler, where
    every shard runs until the busiest is done, gives every shard the busiest one's segments and fails here."""
    cfg, params = model
    rng = np.random.default_rng(0)
    n, group_budgets = 4, [40, 36, 6, 5, 4, 3, 2, 2]
    prompts = _prompts(rng, len(group_budgets), lo=3, hi=6)
    budgets = np.repeat(group_budgets, n)  # [8 * n]: a group's rows share one budget
    kw = dict(dtype="float32", page_size=4, max_num_seqs=32, max_segment=8, max_model_len=64)
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=3)
    four = JaxEngine(cfg, params, mesh=sharding.make_mesh(4, 1, 1, devices=jax.devices()[:4]), **kw)
    assert four._steal
    out = four.generate(prompts, sp, max_new_tokens_per_row=budgets)
    s4 = four.last_stats
    assert s4["shards"] == 4 and s4["stolen"] == 0  # every row admitted at once: nothing left to steal
    np.testing.assert_array_equal(out.lengths, budgets)
    one = JaxEngine(cfg, params, **kw)
    groups = [[Row(rid=i * n + j, prompt=i, ids=np.asarray(p, np.int32), max_tokens=int(budgets[i * n + j]),
                   store=RowStore(1, 1, 0)) for j in range(n)] for i, p in enumerate(prompts)]
    alone = []
    for shard, dealt in enumerate(deal(groups, 4)):  # the engine's deal: a pure function of the request
        ids = [g[0].prompt for g in dealt]
        rows = np.concatenate([np.arange(i * n, (i + 1) * n) for i in ids])
        ref = one.generate([prompts[i] for i in ids], sp, max_new_tokens_per_row=budgets[rows], seeds=rows)
        alone.append(one.last_stats["segments"])
        np.testing.assert_array_equal(out.tokens[rows, : ref.tokens.shape[1]], ref.tokens)
        assert s4["shard_tokens"][shard] == int(budgets[rows].sum())
    assert s4["shard_segments"] == alone, (s4["shard_segments"], alone)
    assert min(alone) < max(alone)  # uneven shares: a lockstep scheduler could not match these counts


def test_max_num_seqs_is_per_shard(model, monkeypatch):
    """max_num_seqs = 2 on 4 shards: each shard decodes two rows at once (8 in all), as vLLM's per-engine limit."""
    cfg, params = model
    live = []
    run = shard_mod.Shard._segment

    def watch(self, plan, sched, spec, st):
        live.append((self.index, plan.live))
        return run(self, plan, sched, spec, st)

    monkeypatch.setattr(shard_mod.Shard, "_segment", watch)
    eng = JaxEngine(cfg, params, dtype="float32", page_size=4, max_num_seqs=2, mesh=sharding.make_mesh(4, 1, 2))
    eng.generate([[5, 6, 7]] * 8, SamplingParams(n=2, temperature=0.0, max_new_tokens=6, ignore_eos=True))
    first = {}
    for i, n in live:
        first.setdefault(i, n)
    assert first == {0: 2, 1: 2, 2: 2, 3: 2} and max(n for _, n in live) == 2  # every shard starts full


@pytest.mark.parametrize("data", [1, 4])
def test_nothing_compiles_after_the_first_calls(model, data):
    """With the ladders built ahead (warm_programs), calls with fresh prompts (other lengths) and fresh response
    budgets compile nothing at all: not an engine program, nor anything else jax compiles."""
    cfg, params = model
    rng = np.random.default_rng(data)
    eng = JaxEngine(cfg, params, dtype="float32", page_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                    max_prompt_length=32, max_model_len=64, warm_programs=True,
                    mesh=sharding.make_mesh(data, 1, 1, devices=jax.devices()[:data]))
    for call in range(5):
        sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=int(rng.integers(8, 32)), seed=call)
        prompts = _prompts(rng, int(rng.integers(3, 9)), lo=2, hi=32)
        before = compile_watch.totals()
        out = eng.generate(prompts, sp, max_new_tokens_per_row=rng.integers(1, sp.max_new_tokens + 1,
                                                                             size=2 * len(prompts)))
        compiled = compile_watch.totals()["compiles"] - before["compiles"]
        assert len(out) == 2 * len(prompts)
        if call >= 1:  # no engine program after the first call (its pool is sized once, not from the rows)
            assert eng.last_stats["programs_compiled"] == 0, (call, eng.last_stats)
        if call >= 2:
            assert compiled == 0, (call, compiled)


@pytest.mark.parametrize("lengths", ["growing", "lognormal"])
def test_later_calls_with_longer_rows_compile_no_engine_program(model, lengths):
    """One device, programs built ahead: each call's rows are longer than the last's (or lognormal prompt lengths
    and budgets, a long tail). The pool is sized once from max_num_seqs x max_model_len, so no later call grows it
    (a pool sized from a call's rows x its longest row grew 31 -> 49 -> 129 pages and rebuilt every program)."""
    cfg, params = model
    rng = np.random.default_rng(7)
    eng = JaxEngine(cfg, params, dtype="float32", page_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                    max_prompt_length=32, max_model_len=64, warm_programs=True,
                    mesh=sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    pages = []
    for call in range(4):
        if lengths == "growing":
            prompt_len, budget = 4 + 8 * call, 8 + 8 * call  # rows of 12, 28, 44, 60 tokens
            prompts = _prompts(rng, 4, lo=prompt_len, hi=prompt_len + 1)
            budgets = np.full(8, budget)
        else:
            prompts = [rng.integers(10, 90, size=int(np.clip(rng.lognormal(1.5, 0.8), 1, 32))).tolist()
                       for _ in range(4)]
            budgets = np.clip(rng.lognormal(2.0, 0.9, size=8), 1, 32).astype(int)
        out = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=call),
                           max_new_tokens_per_row=budgets)
        assert np.all(out.lengths <= budgets)
        pages.append(eng.last_stats["num_pages"])
        if call >= 1:
            assert eng.last_stats["programs_compiled"] == 0, (call, pages, eng.last_stats)
    assert pages == [8 * 64 // 4 + 1] * 4, pages  # max_num_seqs rows of max_model_len tokens, and scratch


# ---- the memory report for the check before the first step ------------------------------------------------


def test_the_engine_reports_its_largest_programs_from_xla_and_the_check_refuses_one_that_cannot_fit(model):
    """`memory_report` compiles the widest decode segment and the longest prefills and returns what a device needs
    while each runs (weights, a pool for one longest row, outputs, temporaries); split over tensor 2, a device
    needs less. The trainer's check (trainer/memory/check.py) refuses the program that does not fit its limit."""
    from jaxrl_llm.errors import DeviceMemoryError
    from jaxrl_llm.trainer.memory.check import MemoryPlan

    cfg, params = model
    kw = dict(dtype="float32", page_size=4, max_num_seqs=64, max_prompt_length=32, max_model_len=64)
    one = JaxEngine(cfg, params, **kw)
    report = dict(one.memory_report())
    assert set(report) == {"decode", "prefill 32", "prefill 64 (continuation)"}, report
    weights = sum(x.nbytes for x in jax.tree.leaves(one.params))
    pool = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 4 * (64 // 4 + 1)
    assert all(v > weights + pool for v in report.values())
    split = dict(JaxEngine(cfg, params, mesh=sharding.make_mesh(1, 1, 2, devices=jax.devices()[:2]),
                           **kw).memory_report())
    assert split["decode"] < report["decode"]
    assert one.last_stats == {} and one._pool is None  # nothing ran, nothing was allocated
    need = max(report.values())
    MemoryPlan(run=None, cfg=None, limit=2 * need).check_engine(one)
    with pytest.raises(DeviceMemoryError, match="generation program"):
        MemoryPlan(run=None, cfg=None, limit=int(0.9 * need)).check_engine(one)
