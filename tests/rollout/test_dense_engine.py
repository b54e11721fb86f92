"""The dense JAX engine (rollout.kv_cache = 'dense', the paged engine's baseline): compaction of finished
rows, cache growth and compiled-program reuse; its outputs equal the paged engine's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import sharding
from jaxrl_llm.models import load_hf, split_model
from jaxrl_llm.rollout import DenseJaxEngine, JaxEngine, SamplingParams
from tests.hf_models import make_hf_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42]]


@pytest.fixture(scope="module")
def hf_and_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf = make_hf_model(d, vocab_size=96, initializer_range=0.3, eos_token_id=7)
    return hf, load_hf(d)


def test_dense_equals_paged(hf_and_model):
    _, model = hf_and_model
    params = split_model(model)[1]
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=20, n=2),
               SamplingParams(temperature=1.0, max_new_tokens=20, n=3, seed=9)):
        a = DenseJaxEngine(model.cfg, params, dtype="float32", prompt_bucket=8, gen_bucket=4).generate(PROMPTS, sp)
        b = JaxEngine(model.cfg, params, dtype="float32", page_size=4).generate(PROMPTS, sp)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
        assert a.finish_reasons == b.finish_reasons


def test_compacting_finished_rows_keeps_outputs(hf_and_model):
    """Rows that stop early leave the running batch; every response still comes back whole, and
    (per-row random streams) sampled exactly as without compaction or chunking."""
    _, model = hf_and_model
    params = split_model(model)[1]
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=4)
    caps = [20, 2, 2, 2, 2, 2, 2, 2, 3, 2, 2, 2, 2, 2, 2, 17]  # 2 long rows: the batch shrinks to 2
    small = DenseJaxEngine(model.cfg, params, dtype="float32", gen_bucket=2)
    big = DenseJaxEngine(model.cfg, params, dtype="float32", gen_bucket=32, max_batch_size=4)  # no compaction
    a = small.generate(PROMPTS, sp, max_new_tokens_per_row=caps)
    b = big.generate(PROMPTS, sp, max_new_tokens_per_row=caps)
    np.testing.assert_array_equal(a.lengths, caps)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)


def test_data_parallel_compaction_matches_one_device(hf_and_model):
    """On a data x fsdp x tensor mesh every shard compacts its own rows; outputs equal one device's."""
    _, model = hf_and_model
    params = split_model(model)[1]
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=4)
    caps = [20, 2, 2, 2, 2, 2, 2, 2, 3, 2, 2, 2, 2, 2, 2, 17]  # shards 0 and 3 keep one live row each
    mesh = sharding.make_mesh(2, 2, 2)
    sharded = DenseJaxEngine(model.cfg, params, dtype="float32", gen_bucket=2, mesh=mesh)
    sharded.trace = True
    a = sharded.generate(PROMPTS, sp, max_new_tokens_per_row=caps)
    assert [r["rows"] for r in sharded.last_trace if r["phase"] == "compact"] == [4]
    b = DenseJaxEngine(model.cfg, params, dtype="float32", gen_bucket=32, max_batch_size=4).generate(
        PROMPTS, sp, max_new_tokens_per_row=caps)
    np.testing.assert_array_equal(a.lengths, caps)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)


def test_compaction_program_moves_no_data_between_devices():
    from jaxrl_llm.rollout import decode

    mesh = sharding.make_mesh(2, 2, 2)
    rows, shards = 16, 4
    batch = lambda *shape: jax.device_put(jnp.zeros((rows, *shape)), sharding.named_sharding(
        mesh, ("batch",) + (None,) * len(shape), (rows, *shape)))
    cache = jax.device_put(jnp.zeros((rows, 2, 12, 8)), sharding.named_sharding(
        mesh, ("batch", "act_kv_heads", None, None), (rows, 2, 12, 8)))
    state = {"done": batch().astype(bool), "tokens": batch(20), "t": jnp.int32(3)}
    sel = np.array([[0], [1], [2], [3]], np.int32)
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda st, c, s, f: decode.compact(st, c, s, sel, f, 16, shards=shards))
        hlo = fn.lower(state, [(cache, cache)], batch().astype(jnp.int32), np.zeros(shards, bool)).compile().as_text()
    for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
        assert op not in hlo, op


def test_batches_with_other_prompt_lengths_reuse_compiled_programs(hf_and_model):
    """The prompt region is a traced value: a batch with longer prompts in the same capacity step
    compiles only its prefill (the decode, growth and sampling programs are reused)."""
    _, model = hf_and_model
    eng = DenseJaxEngine(model.cfg, split_model(model)[1], dtype="float32", prompt_bucket=8, gen_bucket=32)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, ignore_eos=True)
    compiles = []

    def listener(event, duration, **_):
        if event.endswith("backend_compile_duration"):
            compiles.append(_.get("fun_name", "?"))

    eng.generate([[5, 6, 7], [8, 9]], sp)  # prompt slots 8
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = eng.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [8, 9]], sp)  # prompt slots 16
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert out.lengths.tolist() == [10] * 4
    assert [c.removeprefix("jit(").rstrip(")") for c in compiles] == ["_prefill"]


def test_compaction_between_growths_keeps_outputs(hf_and_model):
    """With `compact_every`, rows leave as soon as the live ones fit a smaller power of two, without
    waiting for the cache to fill; outputs equal a run that never compacts."""
    _, model = hf_and_model
    params = split_model(model)[1]
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=4)
    caps = [20, 2, 2, 2, 2, 2, 2, 2, 9, 2, 2, 2, 2, 2, 2, 17]
    eng = DenseJaxEngine(model.cfg, params, dtype="float32", gen_bucket=32, compact_every=4)
    eng.trace = True
    a = eng.generate(PROMPTS, sp, max_new_tokens_per_row=caps)
    phases = [(r["phase"], r["rows"]) for r in eng.last_trace if r["phase"] != "decode"]
    assert phases == [("prefill", 16), ("compact", 4), ("compact", 2), ("compact", 1)]  # checks at t = 5, 9, 17
    never = DenseJaxEngine(model.cfg, params, dtype="float32", gen_bucket=32, compact_every=0)
    never.trace = True
    b = never.generate(PROMPTS, sp, max_new_tokens_per_row=caps)
    assert [r["phase"] for r in never.last_trace] == ["prefill", "decode"]
    np.testing.assert_array_equal(a.lengths, caps)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
