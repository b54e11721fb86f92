"""The JAX sampler (paged): HF-identical greedy output, exact logprobs, seeds, and the sampling distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl_llm import sharding
from jaxrl_llm.models import load_hf, split_model
from jaxrl_llm.rollout import JaxEngine, RolloutError, SamplingParams
from jaxrl_llm.rollout.sampling import truncated_probs
from tests.hf_models import LLAMA3_ROPE, make_hf_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42]]


@pytest.fixture(scope="module")
def hf_and_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf = make_hf_model(d, vocab_size=96, initializer_range=0.3, eos_token_id=7)
    model = load_hf(d)
    return hf, model


@pytest.fixture(scope="module")
def standard_init(tmp_path_factory):
    """HF's own init scale (0.02): logits of ordinary size, for the fp32 logprob tolerance."""
    d = tmp_path_factory.mktemp("hf_std")
    make_hf_model(d, vocab_size=96, eos_token_id=7)
    return load_hf(d)


@pytest.fixture(scope="module")
def engine(hf_and_model):
    _, model = hf_and_model
    return JaxEngine(model.cfg, split_model(model)[1], dtype="float32", page_size=4)


def _hf_greedy(hf, prompt, max_new):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=7,
                      pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_generate(hf_and_model, engine):
    hf, _ = hf_and_model
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=20))
    stops = 0
    for i, prompt in enumerate(PROMPTS):
        ref = _hf_greedy(hf, prompt, 20)
        assert out.response_ids(i) == ref, f"prompt {i}"
        assert out.finish_reasons[i] == ("stop" if ref[-1] == 7 else "length")
        stops += out.finish_reasons[i] == "stop"
        assert len(set(ref)) > 3  # the reference is not a degenerate repeat
    assert out.tokens.shape[1] == out.lengths.max()


@pytest.mark.parametrize("which,atol", [("standard", 1e-5), ("wide", 5e-5)])
def test_sampler_logprobs_equal_teacher_forced_forward(hf_and_model, standard_init, engine, which, atol):
    """fp32 sampler logprobs equal a teacher-forced forward: <= 1e-5 at HF's init scale; the wide
    init (logits ~15x larger) leaves proportionally larger fp32 rounding."""
    model = standard_init if which == "standard" else hf_and_model[1]
    if which == "standard":
        engine = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", page_size=4)
    temp = 0.7
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=temp, top_k=20, max_new_tokens=9, seed=3))
    for r in range(len(out)):
        prompt, resp = PROMPTS[out.prompt_index[r]], out.response_ids(r)
        ids = jnp.asarray([prompt + resp], jnp.int32)
        logits = model(ids)[0] / temp  # [T, V]
        logp = jax.nn.log_softmax(logits, axis=-1)
        pos = np.arange(len(prompt) - 1, len(prompt) + len(resp) - 1)
        ref = np.asarray(logp[pos, np.asarray(resp)])
        np.testing.assert_allclose(out.logprobs[r, : len(resp)], ref, atol=atol, rtol=0)
        assert np.all(out.logprobs[r, len(resp):] == 0)


def test_fixed_seed_reproducible_and_n_rows_share_prompt(engine):
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=11)
    a, b = engine.generate(PROMPTS, sp), engine.generate(PROMPTS, sp)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    c = engine.generate(PROMPTS, sp.replace(seed=12))
    assert not np.array_equal(a.tokens, c.tokens)
    assert list(a.prompt_index) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    greedy = engine.generate(PROMPTS, sp.replace(temperature=0.0))
    for i in range(len(PROMPTS)):
        rows = greedy.tokens[3 * i: 3 * i + 3]
        assert (rows == rows[0]).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (1.0, 10, 0.9)])
def test_first_token_distribution_matches_truncated_softmax(hf_and_model, engine, temperature, top_k, top_p):
    _, model = hf_and_model
    prompt = PROMPTS[0]
    n = 6000
    out = engine.generate([prompt], SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p,
                                                   max_new_tokens=1, seed=5))
    logits = model(jnp.asarray([prompt], jnp.int32))[:, -1]
    expected = np.asarray(truncated_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p))[0]
    counts = np.bincount(out.tokens[:, 0], minlength=expected.size) / n
    assert np.all(counts[expected == 0] == 0), "sampled a token outside the truncated support"
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(counts - expected) <= 5 * sigma + 1e-3)
    if top_k:
        assert (expected > 0).sum() <= top_k


# The other families through the same fused engine layout: Qwen3's q/k norms (no biases, head_dim 24
# unlike hidden / heads, tied head) and Llama 3's scaled RoPE, whose 32-token original context the
# longest prompt plus its response passes.
FAMILIES = {
    "qwen3_tied_head_dim24": dict(family="qwen3", head_dim=24, tie_word_embeddings=True),
    "llama3_rope": dict(family="llama", rope_scaling=LLAMA3_ROPE),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_other_families_greedy_matches_transformers_and_logprobs_the_forward(tmp_path, name):
    hf = make_hf_model(tmp_path, vocab_size=96, initializer_range=0.3, eos_token_id=7, **FAMILIES[name])
    model = load_hf(tmp_path)
    engine = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", page_size=8)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=30))
    for i, prompt in enumerate(PROMPTS):
        ref = _hf_greedy(hf, prompt, 30)
        assert out.response_ids(i) == ref, f"prompt {i}"
        assert len(set(ref)) > 3
    assert max(len(p) + int(n) for p, n in zip(PROMPTS, out.lengths)) > LLAMA3_ROPE["original_max_position_embeddings"]
    # The family's extra weights (q/k norms) shard like the rest on a fsdp x tensor mesh.
    sharded = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", mesh=sharding.make_mesh(1, 4, 2),
                        page_size=8)
    np.testing.assert_array_equal(sharded.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=30)).tokens,
                                  out.tokens)

    temp = 0.7  # the wide init's logits leave fp32 rounding of ~1e-5 (see the logprob test above)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=temp, top_k=20, max_new_tokens=30, seed=3))
    seqs = [PROMPTS[out.prompt_index[r]] + out.response_ids(r) for r in range(len(out))]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)  # [R, L], right padding: causal, harmless
    for r, seq in enumerate(seqs):
        ids[r, : len(seq)] = seq
    logp = np.asarray(jax.jit(lambda i: jax.nn.log_softmax(model(i) / temp, axis=-1))(ids))  # [R, L, V]
    for r in range(len(out)):
        prompt, resp = PROMPTS[out.prompt_index[r]], out.response_ids(r)
        pos = np.arange(len(prompt) - 1, len(prompt) + len(resp) - 1)
        np.testing.assert_allclose(out.logprobs[r, : len(resp)], logp[r, pos, np.asarray(resp)], atol=5e-5, rtol=0)


def test_segments_slots_and_chunks_do_not_change_output(hf_and_model):
    """Short segments, few slots (rows wait and refill them), one-token pages and small prefill calls give
    the same tokens as one big batch: every row keeps its own random stream."""
    _, model = hf_and_model
    params = split_model(model)[1]
    sp = SamplingParams(temperature=1.0, max_new_tokens=17, n=2, seed=2)
    one = JaxEngine(model.cfg, params, dtype="float32").generate(PROMPTS, sp)
    eng = JaxEngine(model.cfg, params, dtype="float32", page_size=1, max_num_seqs=3, max_segment=2,
                    max_num_batched_tokens=16)
    many = eng.generate(PROMPTS, sp)
    assert eng.last_stats["segments"] > 8 and eng.last_stats["admitted"] == 8
    np.testing.assert_array_equal(one.tokens, many.tokens)
    np.testing.assert_allclose(one.logprobs, many.logprobs, atol=2e-5)


def test_sharded_engine_matches_single_device(hf_and_model, engine):
    _, model = hf_and_model
    mesh = sharding.make_mesh(1, 4, 2)
    sharded = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", mesh=mesh, page_size=4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=10, n=2)
    np.testing.assert_array_equal(sharded.generate(PROMPTS, sp).tokens, engine.generate(PROMPTS, sp).tokens)
    qkv = sharded.params["layers"][0]["qkv_w"]  # fused [D, (N + 2K) H]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")  # replicated over fsdp


def test_update_weights_changes_output_and_version(hf_and_model, engine):
    _, model = hf_and_model
    params = split_model(model)[1]
    v = engine.version
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, sp).tokens
    scaled = jax.tree.map(lambda x: x * 1.5, params)
    assert engine.update_weights(scaled) == v + 1
    after = engine.generate(PROMPTS, sp)
    assert after.weight_version == v + 1 and not np.array_equal(before, after.tokens)
    engine.update_weights(params)


@pytest.mark.parametrize("bad,match", [
    (dict(n=0), "n=0"), (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"),
    (dict(temperature=-1.0), "temperature"), (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_sampling_params_fail_before_work(engine, bad, match):
    with pytest.raises(RolloutError, match=match):
        engine.generate(PROMPTS, SamplingParams(**bad))


def test_bad_prompts_fail_before_work(hf_and_model):
    _, model = hf_and_model
    eng = JaxEngine(model.cfg, None, dtype="float32", max_prompt_length=8)
    with pytest.raises(RolloutError, match="prompt 2 has 11 tokens; this engine allows at most 8"):
        eng.generate(PROMPTS, SamplingParams())
    with pytest.raises(RolloutError, match="outside"):
        eng.generate([[1, 2, 500]], SamplingParams())
    with pytest.raises(RolloutError, match="empty"):
        eng.generate([[]], SamplingParams())


def test_per_row_budgets_cap_each_response(engine):
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1, ignore_eos=True)
    caps = [1, 12, 5, 3, 7, 2, 9, 4]
    out = engine.generate(PROMPTS, sp, max_new_tokens_per_row=caps)
    np.testing.assert_array_equal(out.lengths, caps)
    assert all(r == "length" for r in out.finish_reasons)
    full = engine.generate(PROMPTS, sp)
    for r, cap in enumerate(caps):  # each row has its own random stream: capped rows are prefixes
        assert out.response_ids(r) == full.response_ids(r)[:cap]
    with pytest.raises(RolloutError, match="need len"):
        engine.generate(PROMPTS, sp, max_new_tokens_per_row=[3, 4])
