"""The paged engine (rollout/jax_engine.py) under memory pressure, on a tiny fp32 model: preemption and recompute,
shared prompt pages and copy on write, paged attention against dense attention, the memory budget, refusals
before any work, and the data-parallel path. Outputs are compared token for token with an unconstrained paged
run and with the dense engine (rollout/dense_engine.py)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm import sharding
from jaxrl_llm.rollout import (
    DenseJaxEngine,
    JaxEngine,
    RolloutError,
    SamplingParams,
    engine_build,
    jax_engine,
    page_pool,
    paged_decode,
    programs,
)
from jaxrl_llm.rollout import shard as shard_mod
from jaxrl_llm.rollout.page_pool import pages_for
from jaxrl_llm.rollout.scheduler import Scheduler
from jaxrl_llm.trainer.config import ConfigValueError, RolloutConfig
from kernels.decode_attention import decode_attention_reference

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42]]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)  # every row runs to the end
SAMPLED = SamplingParams(n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=5)  # stops at eos (7)
NEED = pages_for(11 + MAX_NEW - 1, 2)  # pages of 2 the longest row writes into: 9
TIGHT = NEED + 2  # pages a device (one scratch): one more usable page than the longest row needs


def paged(model, **kw) -> JaxEngine:
    cfg, params = model
    return JaxEngine(cfg, params, dtype="float32", **{"page_size": 2, **kw})


@pytest.fixture(scope="module")
def unbounded(model):
    """No budget on CPU (no allocator statistics): a pool for every row at full length."""
    return paged(model)


@pytest.fixture(scope="module")
def tight(model, unbounded):
    return paged(model, kv_cache_memory_bytes=unbounded.page_bytes() * TIGHT, max_segment=4)


@pytest.fixture(scope="module")
def dense(model):
    cfg, params = model
    return DenseJaxEngine(cfg, params, dtype="float32", prompt_bucket=16, gen_bucket=8)


@pytest.fixture(scope="module")
def reference():
    """reference(engine, sp): engine.generate(PROMPTS, sp), computed once a module."""
    done = {}

    def get(engine, sp: SamplingParams):
        if (id(engine), sp) not in done:
            done[id(engine), sp] = engine.generate(PROMPTS, sp)
        return done[id(engine), sp]

    return get


@pytest.fixture(autouse=True)
def _fail_on_stalled_segments(monkeypatch):
    """A decode segment that runs no step leaves the scheduler's state as it was, so the shard would plan the
    same segment forever: fail the test instead of hanging it."""
    run = shard_mod.Shard._segment

    def guarded(self, plan, sched, spec, st):
        before = st["decode_steps"]
        done = run(self, plan, sched, spec, st)
        if st["decode_steps"] == before:
            raise AssertionError(f"a decode segment ran no step ({plan.live} rows, {plan.slots} slots, stop_free "
                                 f"{plan.stop_free}): the shard would loop forever")
        return done

    monkeypatch.setattr(shard_mod.Shard, "_segment", guarded)


@pytest.fixture
def schedulers(monkeypatch) -> list[Scheduler]:
    """Every Scheduler the shards build, with `all_rows`: the rows it took (to inspect per-row preemptions)."""
    made = []

    class Recording(Scheduler):
        def __init__(self, pool, source, **kw):
            super().__init__(pool, source, **kw)
            self.all_rows = []
            take = source.take

            def recording_take(fits):
                group = take(fits)
                self.all_rows.extend(group or [])
                return group

            self.source = types.SimpleNamespace(take=recording_take, pending=source.pending, full=source.full)
            made.append(self)

    monkeypatch.setattr(shard_mod, "Scheduler", Recording)
    return made


def assert_same_outputs(a, b, atol=2e-5):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol, rtol=0)
    assert a.finish_reasons == b.finish_reasons


# ---- preemption and recompute ---------------------------------------------------------------------


def test_tight_pool_preempts_all_rows_but_the_oldest_and_keeps_greedy_tokens(unbounded, tight, dense, reference,
                                                                              schedulers):
    """A pool with one usable page more than the longest row needs: every row but the first admitted is preempted
    (the oldest running row is never the newest, so never the victim) and recomputed, and the greedy tokens and
    log-probs equal an unconstrained run's and the dense engine's. Prompt groups are admitted largest first (the
    dealer's order, rollout/dealer.py), so the first admitted is prompt 2, the longest."""
    ref = reference(unbounded, GREEDY)
    assert unbounded.last_stats["preemptions"] == 0
    out = tight.generate(PROMPTS, GREEDY)
    rows = sorted(schedulers[-1].all_rows, key=lambda r: r.rid)
    assert [r.preemptions > 0 for r in rows] == [True, True, False, True]
    assert tight.last_stats["preemptions"] == sum(r.preemptions for r in rows)
    assert tight.last_stats["admitted"] == len(rows) + tight.last_stats["preemptions"]
    assert tight.last_stats["num_pages"] == TIGHT and tight._pool is None  # free_cache_engine: released
    assert_same_outputs(out, ref)
    assert_same_outputs(out, reference(dense, GREEDY))


def test_sampled_outputs_are_unchanged_by_preemption(unbounded, tight, reference):
    """Each row draws from its own stream (seed, row, step), however often it is preempted; resumed siblings
    share their prompt's full pages again. (Unconstrained paged equals dense: tests/rollout/test_dense_engine.py.)"""
    out = tight.generate(PROMPTS, SAMPLED)
    assert tight.last_stats["preemptions"] > 0 and tight.last_stats["shared_pages"] > 0
    assert_same_outputs(out, reference(unbounded, SAMPLED))
    assert "stop" in out.finish_reasons and len(np.unique(out.tokens[:3], axis=0)) > 1


@pytest.mark.parametrize("extra", [3, 0])
def test_a_request_that_fits_the_pool_exactly_runs(model, unbounded, extra):
    """The up-front check accepts a pool of exactly the longest row's pages; the request must then run. Pages of
    4, a 10-token prompt and 3 new tokens: the context (9 tokens) and the longest row (12 positions) both take 3
    pages. With 3 usable pages (extra = 0, the minimum) the row must be admitted, as with 6 (extra = 3)."""
    prompt, sp = [PROMPTS[2][:10]], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    eng = paged(model, page_size=4, kv_cache_memory_bytes=unbounded.page_bytes() * 2 * (1 + 3 + extra))
    np.testing.assert_array_equal(eng.generate(prompt, sp).tokens, unbounded.generate(prompt, sp).tokens)


# ---- shared prompt pages and copy on write --------------------------------------------------------


def test_siblings_share_prompt_pages_and_copy_the_partial_page(model, unbounded):
    """Pages of 2: contexts (prompt less its last token) of 4, 1, 10 and 2 tokens. The n = 3 samples share every
    prompt page; only [10, 11] ends mid-page, and all but its last holder copy that page before writing."""
    out = unbounded.generate(PROMPTS, SAMPLED)
    stats = dict(unbounded.last_stats)
    assert stats["shared_pages"] == 2 * (2 + 1 + 5 + 1) and stats["copies"] == 2
    assert stats["prefill_tokens"] == 4 + 1 + 10 + 2  # siblings prefill nothing
    unshared = paged(model, share_prompt_pages=False)
    assert_same_outputs(unshared.generate(PROMPTS, SAMPLED), out, atol=0)
    assert unshared.last_stats["shared_pages"] == 0 and unshared.last_stats["copies"] == 0
    assert unshared.last_stats["prefill_tokens"] == 3 * (4 + 1 + 10 + 2)


def test_no_copies_when_every_context_ends_on_a_page_boundary(unbounded):
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]  # contexts of 4, 10 and 2 tokens: whole pages of 2
    out = unbounded.generate(prompts, SAMPLED.replace(n=2))
    assert unbounded.last_stats["copies"] == 0 and unbounded.last_stats["shared_pages"] == 2 + 5 + 1
    for i in range(len(prompts)):  # the siblings still sample their own streams
        assert out.response_ids(2 * i) != out.response_ids(2 * i + 1)


# ---- paged attention equals dense attention --------------------------------------------------------


def _dense_layout(pages: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """pages [K, P, ps, H], tables [S, W] -> each slot's positions laid out densely [S, K, W ps, H]."""
    k, _, ps, h = pages.shape
    s, w = tables.shape
    out = np.zeros((s, k, w * ps, h), pages.dtype)
    for i in range(s):
        for p in range(w * ps):
            out[i, :, p] = pages[:, tables[i, p // ps], p % ps]
    return out


def test_attend_over_gathered_pages_equals_dense_decode_attention():
    rng = np.random.default_rng(0)
    kh, n, h, ps, num_pages, w = 2, 4, 16, 4, 16, 3
    kp = rng.normal(size=(kh, num_pages, ps, h)).astype(np.float32)
    vp = rng.normal(size=(kh, num_pages, ps, h)).astype(np.float32)
    tables = rng.permutation(np.arange(1, num_pages))[: 3 * w].reshape(3, w).astype(np.int32)  # out of order
    pos = np.asarray([5, 11, 0], np.int32)  # the query's position: it attends to [0, pos]
    q = rng.normal(size=(3, 1, n, h)).astype(np.float32)
    kg, vg = paged_decode._gather(jnp.asarray(kp), tables), paged_decode._gather(jnp.asarray(vp), tables)
    np.testing.assert_array_equal(kg, _dense_layout(kp, tables))
    mask = np.arange(w * ps)[None, None, :] <= pos[:, None, None]  # [S, 1, W ps]
    got = paged_decode._attend(jnp.asarray(q), kg, vg, jnp.asarray(mask))
    want = decode_attention_reference(jnp.asarray(q), _dense_layout(kp, tables), _dense_layout(vp, tables),
                                      np.zeros(3, np.int32), pos + 1)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_attend_with_a_causal_chunk_equals_a_float64_softmax():
    """Prefill's attention: T queries at positions start..start+T-1 over pages, causally, against numpy fp64."""
    rng = np.random.default_rng(1)
    kh, n, h, ps, w, t, start = 2, 4, 8, 2, 4, 3, 4
    kp = rng.normal(size=(kh, 9, ps, h)).astype(np.float32)
    vp = rng.normal(size=(kh, 9, ps, h)).astype(np.float32)
    tables = np.asarray([[7, 2, 5, 1]], np.int32)
    q = rng.normal(size=(1, t, n, h)).astype(np.float32)
    positions = start + np.arange(t)
    mask = np.arange(w * ps)[None, None, :] <= positions[None, :, None]  # [1, T, W ps]
    got = paged_decode._attend(jnp.asarray(q), paged_decode._gather(jnp.asarray(kp), tables),
                               paged_decode._gather(jnp.asarray(vp), tables), jnp.asarray(mask))
    kd, vd = _dense_layout(kp, tables)[0].astype(np.float64), _dense_layout(vp, tables)[0].astype(np.float64)
    want = np.zeros((t, n, h))
    for i, p in enumerate(positions):
        for head in range(n):
            g = head // (n // kh)
            s = kd[g, : p + 1] @ q[0, i, head].astype(np.float64) / np.sqrt(h)
            e = np.exp(s - s.max())
            want[i, head] = (e / e.sum()) @ vd[g, : p + 1]
    np.testing.assert_allclose(got[0], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sp", [GREEDY, SAMPLED.replace(n=1, seed=3)], ids=["greedy", "sampled"])
def test_prefill_chunk_and_decode_segment_equal_the_dense_engine(unbounded, dense, sp, reference):
    """The paged functions on shuffled pages (and padding slots), in two segments, give the dense engine's tokens
    and log-probs."""
    ps, num_pages, max_seg = 4, 24, MAX_NEW
    spec = unbounded._spec(sp, "xla")
    rng = np.random.default_rng(2)
    need = [pages_for(len(p) + MAX_NEW - 1, ps) for p in PROMPTS]
    order = rng.permutation(np.arange(1, num_pages))
    w = max(need)
    tables = np.zeros((6, w), np.int32)  # 4 rows and 2 empty slots (page 0: scratch)
    for i, k in enumerate(need):
        tables[i, :k], order = order[:k], order[k:]
    ctx = np.asarray([len(p) - 1 for p in PROMPTS] + [0, 0], np.int32)
    ids = np.zeros((6, 16), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p) - 1] = p[:-1]
    pool = paged_decode.alloc_pool(num_pages, ps, spec, jnp.float32)
    prefill = jax.jit(paged_decode.prefill_chunk, static_argnames="spec")
    pool, routes = prefill(unbounded.params, pool, ids, tables, np.zeros(6, np.int32), ctx, np.zeros(6, np.int32),
                           spec=spec)
    assert routes is None  # a dense model records no routing
    decode = jax.jit(paged_decode.decode_segment, static_argnames=("spec", "max_seg"))
    last = np.asarray([p[-1] for p in PROMPTS] + [0, 0], np.int32)
    active = np.arange(6) < 4
    state = dict(pos=ctx, last=last, t=np.zeros(6, np.int32), active=active)
    tokens, logps = [[] for _ in range(4)], [[] for _ in range(4)]
    for seg_len in (3, max_seg):
        pool, out = decode(unbounded.params, pool, tables, state["pos"], state["last"], state["t"],
                           np.full(6, MAX_NEW, np.int32), state["active"], np.arange(6, dtype=np.int32),
                           np.zeros(6, np.int32), jax.random.key(sp.seed), np.int32(seg_len), np.int32(7),
                           spec=spec, max_seg=max_seg)
        out = jax.device_get(out)
        assert not out["count"][4:].any()  # padding slots never step
        for i in range(4):
            c = int(out["count"][i])
            tokens[i] += out["tokens"][i, :c].tolist()
            logps[i] += out["logps"][i, :c].tolist()
            if c:
                state["last"][i] = out["tokens"][i, c - 1]
        state = dict(pos=state["pos"] + out["count"], last=state["last"], t=state["t"] + out["count"],
                     active=out["active"])
    want = reference(dense, sp)
    for i in range(4):
        assert tokens[i] == want.response_ids(i), f"row {i}"
        np.testing.assert_allclose(logps[i], want.logprobs[i, : want.lengths[i]], atol=2e-5, rtol=0)


# ---- the memory budget -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tensor", [("float32", 1), ("bfloat16", 1), ("bfloat16", 2)])
def test_page_bytes_is_one_pages_kv_on_one_device(model, dtype, tensor):
    cfg, _ = model
    mesh = sharding.make_mesh(1, 4, 2) if tensor == 2 else None
    eng = JaxEngine(cfg, None, dtype=dtype, mesh=mesh, page_size=16)
    itemsize = jnp.dtype(dtype).itemsize
    heads = cfg.num_key_value_heads // tensor  # kv heads split over "tensor"
    assert eng.page_bytes() == 2 * cfg.num_hidden_layers * heads * cfg.head_dim * itemsize * 16
    assert eng.workspace_bytes(8) > 0


def test_pool_stays_within_kv_cache_memory_bytes_and_is_kept_or_released(model, unbounded):
    pb = unbounded.page_bytes()
    budget = pb * TIGHT + pb // 2  # not a whole number of pages: rounded down
    keep = paged(model, kv_cache_memory_bytes=budget, max_segment=4, free_cache_engine=False)
    out = keep.generate(PROMPTS, GREEDY)
    stats = keep.last_stats
    assert stats["num_pages"] == TIGHT and stats["budget_source"] == "kv_cache_memory_bytes"
    assert stats["kv_bytes"] == TIGHT * pb <= budget
    held = sum(x.addressable_shards[0].data.nbytes for kv in keep._pool for x in kv)
    assert held == TIGHT * pb <= budget  # what the device really holds
    budget_obj = keep._budget
    assert_same_outputs(keep.generate(PROMPTS, GREEDY), out, atol=0)
    assert keep._pool is not None and keep._budget is budget_obj  # kept and reused, not re-sized
    keep.release()
    assert keep._pool is None
    unbounded.generate([[1, 2]], GREEDY.replace(max_new_tokens=2))
    assert unbounded._pool is None and unbounded.last_stats["budget_source"] == "unbounded"


# ---- compiled programs kept between processes ------------------------------------------------------


def test_a_new_engine_loads_its_programs_from_disk(model, unbounded, reference, tmp_path, monkeypatch, caplog):
    """With jax's persistent cache on, every program an engine compiles (but the pool's zeros) is also kept
    serialized, keyed without tracing. In the same process a second engine of the same config shares them and
    compiles nothing. A new process (here: with the process's programs dropped) loads every file back under the
    keys the first engine computed; a damaged file is skipped with a warning; another config has a folder of its
    own. The store is off on the CPU by default: XLA:CPU cannot always run an executable loaded back ("Function
    ... not found"), so running loaded programs is checked on GPUs (BENCHMARKS.md, the warm-cache runs)."""
    assert programs.default_dir() is None
    monkeypatch.setattr(engine_build, "default_dir", lambda: str(tmp_path))
    programs.forget_held()
    first = paged(model)
    out = first.generate(PROMPTS, SAMPLED)
    assert_same_outputs(out, reference(unbounded, SAMPLED), atol=0)
    built = first._programs.stats["compiled"]
    assert built >= 3 and first._programs.stats["loaded"] == 0  # prefill, copy, decode at least
    kept = {p.stem for p in tmp_path.rglob("*.bin")}
    assert len(kept) == built
    same_process = paged(model)
    assert_same_outputs(same_process.generate(PROMPTS, SAMPLED), out, atol=0)
    assert same_process._programs.stats == dict(compiled=0, loaded=0, moved=0, compile_s=0.0, load_s=0.0, move_s=0.0)
    held = set(programs._HELD)
    assert kept <= held
    programs.forget_held()
    second = paged(model)  # starts loading its folder at construction
    assert second._programs.finish_preload() == len(kept) == second._programs.stats["loaded"]
    assert set(programs._HELD) == kept
    next(tmp_path.rglob("_decode-*.bin")).write_bytes(b"not an executable")
    programs.forget_held()
    third = paged(model)
    assert third._programs.finish_preload() == len(kept) - 1 and "could not be loaded" in caplog.text
    programs.forget_held()
    other = paged(model, max_segment=4)
    assert other._programs.directory != first._programs.directory and other._programs.finish_preload() == 0


# ---- refusals before any work ----------------------------------------------------------------------


def _forbid_device_work(monkeypatch, eng):
    def forbidden(*_, **__):
        raise AssertionError("device work ran before the request was refused")

    monkeypatch.setattr(eng, "_warm", forbidden)
    for name in ("alloc", "run"):
        monkeypatch.setattr(shard_mod.Shard, name, forbidden)


def test_pool_too_small_for_the_longest_row_is_refused_before_any_work(model, unbounded, monkeypatch):
    eng = paged(model, kv_cache_memory_bytes=unbounded.page_bytes() * NEED)  # one page short (one is scratch)
    _forbid_device_work(monkeypatch, eng)
    with pytest.raises(RolloutError) as err:
        eng.generate(PROMPTS, GREEDY)
    msg = str(err.value)
    for key in ("rollout.gpu_memory_utilization", "rollout.kv_cache_memory_bytes", "data.max_response_length"):
        assert key in msg
    assert f"{NEED - 1} usable pages" in msg and f"needs {NEED}" in msg
    assert eng.last_stats == {} and eng._pool is None  # nothing generated, nothing allocated


def test_device_memory_share_too_small_is_refused_before_any_work(model, monkeypatch):
    eng = paged(model)
    _forbid_device_work(monkeypatch, eng)
    monkeypatch.setattr(page_pool, "device_memory", lambda device=None: (2 << 30, int(1.7 * 2**30), 0))
    with pytest.raises(RolloutError, match=r"rollout.gpu_memory_utilization = 0.9 of 2.0 GiB, less 1.7 GiB in use"):
        eng.generate(PROMPTS, GREEDY)
    assert eng.last_stats == {} and eng._pool is None


@pytest.mark.parametrize("kwargs,key", [
    (dict(page_size=3), "rollout.page_size"), (dict(page_size=0), "rollout.page_size"),
    (dict(gpu_memory_utilization=1.5), "rollout.gpu_memory_utilization"),
    (dict(gpu_memory_utilization=0.0), "rollout.gpu_memory_utilization"),
    (dict(kv_cache_memory_bytes=0), "rollout.kv_cache_memory_bytes"),
    (dict(max_num_seqs=0), "rollout.max_num_seqs"), (dict(max_num_batched_tokens=8), "rollout.max_num_batched_tokens"),
    (dict(state_update="inplace"), "rollout.state_update"),
])
def test_bad_engine_values_name_their_key(model, kwargs, key):
    cfg, _ = model
    with pytest.raises(ValueError, match=key):
        JaxEngine(cfg, None, dtype="float32", **kwargs)


@pytest.mark.parametrize("kwargs,key", [
    (dict(kv_cache="bogus"), "rollout.kv_cache"), (dict(gpu_memory_utilization=1.5), "rollout.gpu_memory_utilization"),
    (dict(gpu_memory_utilization=0.0), "rollout.gpu_memory_utilization"), (dict(page_size=3), "rollout.page_size"),
    (dict(kv_cache_memory_bytes=0), "rollout.kv_cache_memory_bytes"), (dict(state_update="x"), "rollout.state_update"),
])
def test_bad_rollout_config_names_its_key(kwargs, key):
    RolloutConfig().validate()
    with pytest.raises(ConfigValueError, match=key):
        RolloutConfig(**kwargs).validate()


def test_rollout_config_builds_the_paged_or_dense_engine(model):
    cfg, _ = model
    rollout = RolloutConfig(page_size=4, kv_cache_memory_bytes=1 << 20, max_num_seqs=12, free_cache_engine=False)
    eng = jax_engine.make_jax_engine(cfg, None, None, rollout=rollout, max_prompt_length=64)
    assert isinstance(eng, JaxEngine)
    assert (eng.page_size, eng.kv_cache_memory_bytes, eng.max_num_seqs, eng.free_cache_engine) == (4, 1 << 20, 12,
                                                                                                    False)
    dense = jax_engine.make_jax_engine(cfg, None, None, rollout=RolloutConfig(kv_cache="dense"), max_prompt_length=64)
    assert isinstance(dense, DenseJaxEngine)


# ---- random budgets --------------------------------------------------------------------------------


@settings(max_examples=5, deadline=None, database=None)
@given(page_size=st.sampled_from([2, 4]), extra=st.integers(0, 8), max_num_seqs=st.sampled_from([2, 3, 16]),
       max_segment=st.sampled_from([4, 64]))
def test_greedy_tokens_equal_an_unconstrained_run_for_any_budget_that_fits(model, unbounded, reference, page_size,
                                                                            extra, max_num_seqs, max_segment):
    sp = GREEDY.replace(ignore_eos=False)
    need = pages_for(11 + MAX_NEW - 1, page_size)
    pb = unbounded.page_bytes() // 2 * page_size
    eng = paged(model, page_size=page_size, kv_cache_memory_bytes=pb * (need + 1 + extra), max_num_seqs=max_num_seqs,
                max_segment=max_segment)
    out = eng.generate(PROMPTS, sp)
    assert eng.last_stats["num_pages"] == need + 1 + extra
    np.testing.assert_array_equal(out.tokens, reference(unbounded, sp).tokens)


# ---- data parallel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sp", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_data_parallel_tight_pool_equals_one_device(model, unbounded, sp, reference):
    """(data 4, fsdp 1, tensor 2): four shards, each with a pool of its own of TIGHT pages a device, half the kv
    heads a device; tokens equal the single-device engine's."""
    cfg, params = model
    mesh = sharding.make_mesh(4, 1, 2)
    pb = JaxEngine(cfg, None, dtype="float32", mesh=mesh, page_size=2).page_bytes()
    assert pb == unbounded.page_bytes() // 2
    eng = JaxEngine(cfg, params, dtype="float32", mesh=mesh, page_size=2, kv_cache_memory_bytes=pb * TIGHT,
                    max_segment=4)
    out = eng.generate(PROMPTS, sp)
    assert eng.last_stats["num_pages"] == TIGHT and eng.last_stats["kv_bytes"] <= pb * TIGHT  # each shard's pool
    assert_same_outputs(out, reference(unbounded, sp))


def test_data_parallel_rows_on_one_shard(model, unbounded):
    """One prompt, n = 2, on four data shards: both rows decode on the shard holding the prompt's pages while the
    other shards idle (nobody waits)."""
    cfg, params = model
    eng = JaxEngine(cfg, params, dtype="float32", mesh=sharding.make_mesh(4, 1, 2), page_size=2)
    sp = GREEDY.replace(n=2, max_new_tokens=4)
    np.testing.assert_array_equal(eng.generate(PROMPTS[:1], sp).tokens, unbounded.generate(PROMPTS[:1], sp).tokens)
