"""The agent loop on real engines with a random tiny model: sampled multi-turn trajectories whose turns
always call the tool (a random model writes no calls). Per-turn sampler log-probs equal one forward pass
over the whole sequence; the same seed gives the same trajectory however the turns interleave; the JAX
engine and the vLLM pool give the same greedy trajectory. The GRPO loss and its gradient ignore mask-0
tokens."""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.agent.config import MultiTurnConfig
from jaxrl_llm.agent.loop import AgentLoop
from jaxrl_llm.agent.tools import ToolCall, ToolRunner
from jaxrl_llm.algorithms import PolicyLossConfig, compute_loss_norm, compute_policy_loss_vanilla
from jaxrl_llm.data import multiply as demo
from jaxrl_llm.models import load_hf, split_model
from jaxrl_llm.rollout import JaxEngine, SamplingParams
from tests.hf_models import make_hf_model

VOCAB = 24
STOPS = (1, 3, 4, 5)  # <eos> and three digits end a turn, so turns are short
MAX_LEN = 40


class AlwaysCalls:
    """A call format under which every assistant turn calls multiply on the row's numbers."""

    name = "always"

    def parse(self, text):
        return [ToolCall("multiply", {"a": 37, "b": 48})]


def make_runner(delayed: int = 0):
    """multiply, whose first `delayed` calls wait until the returned gate is set."""
    gate, started, lock = threading.Event(), [0], threading.Lock()

    def multiply(a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
          a: the first factor.
          b: the second factor.
        """
        with lock:
            started[0] += 1
            wait = started[0] <= delayed
        if wait:
            gate.wait(10)
        return a * b
    return ToolRunner([multiply]), gate


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    make_hf_model(d, vocab_size=VOCAB, eos_token_id=1, initializer_range=0.1, max_position_embeddings=128)
    return load_hf(d)


def _rows(tok, count):
    ds = demo.MultiplyDataset(tok, split="test")
    return [ds[i] for i in range(count)]


def _run(generate, rows, sampling, runner, tok):
    loop = AgentLoop(generate, tok, runner, AlwaysCalls(), MultiTurnConfig(enable=True, max_assistant_turns=3),
                     max_response_length=MAX_LEN)
    return loop.run(rows, sampling)


def test_turn_logprobs_equal_one_forward_over_the_whole_sequence_and_interleaving_changes_nothing(model):
    tok = demo.build_tokenizer()
    engine = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", page_size=4)
    rows = _rows(tok, 2)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_LEN, stop_token_ids=STOPS, seed=7)
    runner, _ = make_runner()
    calls = []

    def generate(*args, **kwargs):
        calls.append(list(kwargs["seeds"]))
        return engine.generate(*args, **kwargs)

    out = _run(generate, rows, sampling, runner, tok)
    runner.close()
    assert out.num_turns.max() >= 3 and (out.loss_mask == 0).any()
    # One forward pass over each whole sequence (prompt + every turn), batched and right-padded.
    seqs = [rows[out.prompt_index[r]]["prompt_ids"] + out.tokens[r, : out.lengths[r]].tolist() for r in range(len(out))]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for r, seq in enumerate(seqs):
        ids[r, : len(seq)] = seq
    graphdef, params = split_model(model)
    logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, jnp.asarray(ids)) / sampling.temperature
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))  # [R, T, V]
    for r, seq in enumerate(seqs):
        p, n = len(seq) - out.lengths[r], out.lengths[r]
        ref = logp[r, np.arange(p - 1, p + n - 1), ids[r, p:p + n]]
        mask = out.loss_mask[r, :n] > 0
        np.testing.assert_allclose(out.logprobs[r, :n][mask], ref[mask], atol=5e-5, rtol=0)
    # The first two tool calls wait until the others' second turns are sampled: other engine calls, the
    # same trajectories.
    runner, gate = make_runner(delayed=2)
    calls_again = []

    def generate_and_release(*args, **kwargs):
        calls_again.append(list(kwargs["seeds"]))
        if len(calls_again) == 2:
            gate.set()
        return engine.generate(*args, **kwargs)

    again = _run(generate_and_release, rows, sampling, runner, tok)
    runner.close()
    assert calls_again != calls
    np.testing.assert_array_equal(again.tokens, out.tokens)
    np.testing.assert_array_equal(again.loss_mask, out.loss_mask)
    np.testing.assert_allclose(again.logprobs, out.logprobs, atol=1e-6)


def test_the_grpo_loss_and_its_gradient_ignore_mask_zero_tokens():
    """Tool tokens inserted with mask 0 (and any log-probs) leave the loss and the gradient on the sampled
    tokens unchanged, in every aggregation mode that does not count padding."""
    rng = np.random.default_rng(0)
    b, t = 4, 6
    old = rng.normal(-1.0, 0.3, (b, t)).astype(np.float32)
    new = (old + rng.normal(0, 0.2, (b, t))).astype(np.float32)
    adv = np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32)
    mask = (np.arange(t)[None] < np.array([[6], [4], [5], [2]])).astype(np.float32)
    insert = 3  # tool tokens go in at column 3 (after the first turn)
    pad = lambda x, fill: np.concatenate([x[:, :insert], np.full((b, 4), fill, x.dtype), x[:, insert:]], 1)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        cfg = PolicyLossConfig(loss_agg_mode=mode)

        def loss(new, old, adv, mask, cfg=cfg):
            norm = compute_loss_norm(mask, max_len=16)
            return compute_policy_loss_vanilla(old, new, adv, mask, config=cfg, norm=norm)[0]
        grad = jax.value_and_grad(loss)
        value, g = grad(new, old, adv, mask)
        value2, g2 = grad(pad(new, -9.0), pad(old, -1.0), pad(adv, 5.0), pad(mask, 0.0))
        np.testing.assert_allclose(value2, value, rtol=1e-6, err_msg=mode)
        np.testing.assert_allclose(np.delete(np.asarray(g2), np.s_[insert:insert + 4], 1), g, rtol=1e-6)
        assert np.all(np.asarray(g2)[:, insert:insert + 4] == 0)


@pytest.mark.vllm
def test_jax_engine_and_vllm_pool_give_the_same_greedy_trajectory(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("ray") is None:
        pytest.skip("vllm/ray not installed")
    import ray

    from jaxrl_llm.rollout.vllm_pool import VllmPool

    # head_dim 32 (vLLM CPU's attention needs >= 32); float32 so that greedy paths agree exactly.
    make_hf_model(tmp_path / "hf", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=1, initializer_range=0.3, eos_token_id=1)
    model = load_hf(tmp_path / "hf")
    tok = demo.build_tokenizer()
    rows = _rows(tok, 2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_LEN, stop_token_ids=STOPS)
    run = functools.partial(_run, rows=rows, sampling=greedy, tok=tok)
    engine = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", page_size=4)
    runner, _ = make_runner()
    ours = run(engine.generate, runner=runner)
    runner.close()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = None
    try:
        pool = VllmPool(str(tmp_path / "hf"), num_workers=1, dtype="float32", max_prompt_length=8 + MAX_LEN,
                        max_model_len=8 + 2 * MAX_LEN, num_cpus=1, env_vars=dict(TORCHDYNAMO_DISABLE="1"),
                        engine_kwargs=dict(kv_cache_memory_bytes=16 << 20, max_num_seqs=8, max_num_batched_tokens=256))
        runner, _ = make_runner()
        theirs = run(pool.generate, runner=runner)
        runner.close()
    finally:
        if pool is not None:
            pool.shutdown()
        ray.shutdown()
    assert ours.num_turns.max() >= 3
    np.testing.assert_array_equal(theirs.tokens, ours.tokens)
    np.testing.assert_array_equal(theirs.loss_mask, ours.loss_mask)
    np.testing.assert_allclose(theirs.logprobs, ours.logprobs, atol=1e-4)
