"""MoE routing replay (actor.router_replay R2/R3): the router takes given experts and still learns, both
JAX samplers record the routing the trainer computes, replaying a bf16 sampler's routing makes an fp32
trainer use exactly its experts and shrinks the log-prob gap, and replay is the same sharded over the
expert axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import sharding
from jaxrl_llm.algorithms import logprobs_from_logits
from jaxrl_llm.models import PRESETS, graphdef_and_abstract_params, init_params, split_model
from jaxrl_llm.models.moe import route
from jaxrl_llm.rollout import JaxEngine, SamplingParams

PROMPTS = [[5, 6, 8, 9, 10], [11, 12], [3, 4, 5, 6, 8, 9, 10, 11, 12, 13], [40, 41]]


@pytest.fixture(scope="module")
def model():
    # initializer_range 0.1: router logits of a few tenths, so some tokens sit near a routing tie.
    cfg = PRESETS["tiny_moe"](dtype="float32", param_dtype="float32", initializer_range=0.1)
    graphdef, _ = graphdef_and_abstract_params(cfg)
    return nnx.merge(graphdef, init_params(cfg, seed=0))


def test_route_replays_the_given_experts_with_the_live_routers_weights():
    rng = np.random.default_rng(0)
    x, router = jnp.asarray(rng.normal(size=(6, 16)), jnp.float32), jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    replay = np.array([[3, 5], [0, 7], [-1, -1], [6, 1], [2, -1], [4, 4]], np.int32)
    _, own_w, own = route(x, router, top_k=2, norm_topk_prob=True)
    _, w, experts = route(x, router, top_k=2, norm_topk_prob=True, replay=jnp.asarray(replay))
    given = (replay >= 0).all(-1)
    np.testing.assert_array_equal(np.asarray(experts)[given], replay[given])
    np.testing.assert_array_equal(np.asarray(experts)[~given], np.asarray(own)[~given])  # a -1 routes itself
    probs = np.asarray(jax.nn.softmax(x @ router, axis=-1), np.float64)
    want = np.take_along_axis(probs, np.asarray(experts), -1)
    np.testing.assert_allclose(w, want / want.sum(-1, keepdims=True), rtol=1e-5)  # norm_topk_prob
    np.testing.assert_allclose(np.asarray(w)[~given], np.asarray(own_w)[~given], rtol=1e-6)

    # The router still gets gradients through the replayed experts' weights.
    grad = jax.grad(lambda r: jnp.sum(route(x, r, top_k=2, norm_topk_prob=False, replay=jnp.asarray(replay))[1]
                                      * jnp.arange(2.0)))(router)
    assert float(jnp.max(jnp.abs(grad))) > 1e-3


def _sequences(out, prompts):
    return [np.asarray(prompts[out.prompt_index[r]] + out.response_ids(r)) for r in range(len(out))]


def _trainer_forward(model, seqs, routed=None):
    """The trainer's model on right-padded sequences, in one call: (log-probs of each next token [R, T-1],
    the experts it used [R, T, L_moe, k]); `routed` [R, >= T, L_moe, k] replays recorded routing."""
    width = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), width), np.int32)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    mask = (ids > 0) | (np.arange(width)[None] < np.array([len(s) for s in seqs])[:, None])
    rec = None if routed is None else jnp.asarray(routed[:, :width])
    h, routing = jax.jit(lambda i, m, r: model.hidden_states(i, attention_mask=m, with_routing=True,
                                                             routed_experts=r))(ids, mask.astype(np.int32), rec)
    lp = logprobs_from_logits(model.logits_from_hidden(h)[:, :-1], jnp.asarray(ids[:, 1:]))
    return np.asarray(lp), np.asarray(routing)


def test_the_sampler_records_the_routing_the_trainer_computes(model):
    """fp32 sampler and trainer: every fed token's experts, prompt (prefill) and response (decode), in
    the order the trainer's top-k gives them; -1 for the last token (never fed) and past each sequence.
    The paged engine shares prompt pages between the n samples (the others copy the prompt's routing).
    (The dense engine records through a GRPO step in tests/trainer/test_moe_runs.py.)"""
    eng = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", max_prompt_length=16, page_size=4)
    out = eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=9, return_routed_experts=True, seed=1))
    assert out.routed_experts.shape == (8, 10 + out.tokens.shape[1], 2, 2)  # [R, P + T, L_moe, k]
    seqs = _sequences(out, PROMPTS)
    _, routing = _trainer_forward(model, seqs)
    for r, seq in enumerate(seqs):
        np.testing.assert_array_equal(out.routed_experts[r, : len(seq) - 1], routing[r, : len(seq) - 1])
        assert (out.routed_experts[r, len(seq) - 1:] == -1).all()
    assert eng.generate(PROMPTS, SamplingParams(max_new_tokens=3)).routed_experts is None  # off by default


def test_replay_uses_the_bf16_samplers_experts_and_shrinks_the_logprob_gap(model):
    """The paged sampler in bf16, the trainer in fp32: without replay the trainer routes some tokens to
    other experts than the sampler did; replaying the recorded routing makes it use exactly the sampler's
    experts, and the |trainer - sampler| log-prob gap shrinks (most of all its worst tokens)."""
    eng = JaxEngine(model.cfg, split_model(model)[1], dtype="bfloat16", max_prompt_length=16, page_size=8)
    out = eng.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=16, return_routed_experts=True, seed=0))
    seqs = _sequences(out, PROMPTS)
    flips, gaps = [], {False: [], True: []}
    for replay in (False, True):
        lp, routing = _trainer_forward(model, seqs, out.routed_experts if replay else None)
        for r, seq in enumerate(seqs):
            n, start = len(seq), len(seq) - out.lengths[r] - 1  # start: the position predicting token 0
            gaps[replay].append(np.abs(lp[r, start: n - 1] - out.logprobs[r, : out.lengths[r]]))
            rec, used = out.routed_experts[r, : n - 1], routing[r, : n - 1]
            if replay:
                np.testing.assert_array_equal(used, rec)
            else:
                flips.append((np.sort(used, -1) != np.sort(rec, -1)).any(-1))
    assert np.concatenate(flips).any(), "no routing differs between bf16 and fp32: the test shows nothing"
    without, with_replay = np.concatenate(gaps[False]), np.concatenate(gaps[True])
    assert with_replay.mean() < 0.8 * without.mean()
    assert with_replay.max() < 0.5 * without.max()


def test_replay_is_the_same_sharded_over_the_expert_axis():
    """Hidden states with replayed routing (some tokens -1: routed live) on fsdp 2 x expert 4 equal one
    device's (a sparse layer, then a dense one)."""
    cfg = PRESETS["tiny_moe"](mlp_only_layers=[1])
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(2, cfg.vocab_size, (8, 10)))
    rec = rng.integers(0, cfg.num_experts, (8, 10, 1, cfg.num_experts_per_tok))  # [B, T, L_moe, k]
    rec[rec[..., 0] == rec[..., 1]] = -1  # a token with one expert twice is routed live instead
    rec = jnp.asarray(rec, jnp.int16)
    graphdef, _ = graphdef_and_abstract_params(cfg)
    forward = jax.jit(lambda p: nnx.merge(graphdef, p).hidden_states(ids, routed_experts=rec, with_routing=True))
    ref, ref_used = forward(init_params(cfg, seed=3))
    mesh = sharding.make_mesh(1, 2, 1, expert=4)
    with jax.set_mesh(mesh):
        h, used = forward(init_params(cfg, mesh=mesh, seed=3))
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(used, ref_used)
    given = np.asarray(rec[..., 0]) >= 0
    np.testing.assert_array_equal(np.asarray(used)[given], np.asarray(rec)[given])


def test_r3_with_multi_turn_is_one_clear_error():
    from jaxrl_llm.trainer.config import ConfigValueError, RouterReplaySettings

    with pytest.raises(ConfigValueError, match="multi_turn.enable"):
        RouterReplaySettings(mode="R3").validate("jax", multi_turn=True)
    RouterReplaySettings(mode="R2").validate("jax", multi_turn=True)


def test_replay_on_a_qwen35_moe_packed_micro_batch_gives_the_recording_passs_logprobs():
    """Qwen3.5-MoE: every layer is sparse, the linear-attention ones (`linear_layers`) as well as the attention ones
    (`layers`), so L_moe runs over both stacks in layer order. R2 through the trainer's pieces: the old-log-prob
    pass records the packed micro-batch's routing (two sequences share a row), it goes to sequence layout and back
    into the micro-batch, and the update's forward replaying it uses exactly those experts and gives the recording
    pass's log-probs. A bf16 pass replaying the fp32 pass's routing (R3's case: another forward's routing) uses the
    fp32 experts in every layer."""
    from jaxrl_llm.trainer import router_replay
    from jaxrl_llm.trainer.batch import PackShape, TrainBatch, build_micro_batch
    from jaxrl_llm.trainer.steps import make_logprob_fn

    cfg = PRESETS["tiny_qwen35_moe"](initializer_range=0.1)
    assert cfg.sparse_layers == (0, 1, 2, 3) and cfg.layer_stacks == {"layers": (1, 3), "linear_layers": (0, 2)}
    rng = np.random.default_rng(0)
    lengths = [9, 6, 12]
    responses = np.zeros((3, 12), np.int32)
    for r, n in enumerate(lengths):
        responses[r, :n] = rng.integers(2, cfg.vocab_size, n)
    batch = TrainBatch(prompt_ids=[rng.integers(2, cfg.vocab_size, n).astype(np.int32) for n in (5, 7, 4)],
                       responses=responses, response_mask=(responses > 0).astype(np.float32),
                       group_ids=np.arange(3, dtype=np.int32))
    placements, shape = [(0, 0, 0), (1, 0, 14), (2, 1, 0)], PackShape(rows=2, length=32, max_seqs=4, resp_len=12)
    seq_lengths = batch.prompt_lengths + batch.response_lengths
    graphdef, _ = graphdef_and_abstract_params(cfg)
    params = init_params(cfg, seed=0)
    record = make_logprob_fn(graphdef, temperature=1.0, chunk_size=64, with_routing=True)

    host = build_micro_batch(batch, placements, shape)
    recorded = jax.device_get(record(params, {k: v for k, v in host.items() if k not in ("seq_ids", "seq_start")}))
    assert recorded["routing"].shape == (2, 32, 4, cfg.num_experts_per_tok)  # [rows, L, L_moe, k]
    seq: dict = {}
    router_replay.unpack(recorded["routing"], host, seq_lengths, seq)
    batch.fields[router_replay.FIELD] = router_replay.to_train_layout(seq[router_replay.FIELD], 20)
    host = build_micro_batch(batch, placements, shape)
    mb = {k: v for k, v in host.items() if k not in ("seq_ids", "seq_start")}
    valid = host["segment_ids"] > 0
    np.testing.assert_array_equal(mb[router_replay.FIELD], np.where(valid[..., None, None], recorded["routing"], -1))
    replayed = jax.device_get(record(params, mb))
    # The same routing, exactly; the log-probs of two programs (the replay's takes the routing as an input) equal
    # to fp32 rounding: bit for bit with XLA's CPU MLIR emitters, 3e-7 relative apart with the legacy ones conftest
    # picks. Another expert anywhere moves them by orders more.
    np.testing.assert_array_equal(replayed["routing"][valid], recorded["routing"][valid])
    np.testing.assert_allclose(replayed["log_prob"], recorded["log_prob"], rtol=4e-6, atol=0)

    bf16 = PRESETS["tiny_qwen35_moe"](initializer_range=0.1, dtype="bfloat16")
    bf_graphdef, _ = graphdef_and_abstract_params(bf16)
    bf_record = make_logprob_fn(bf_graphdef, temperature=1.0, chunk_size=64, with_routing=True)
    live = jax.device_get(bf_record(params, {k: v for k, v in mb.items() if k != router_replay.FIELD}))
    flips = (np.sort(live["routing"], -1) != np.sort(recorded["routing"], -1)).any(-1)[valid]  # [tokens, L_moe]
    assert flips.any(), "bf16 and fp32 route alike: the replay below shows nothing"
    used = jax.device_get(bf_record(params, mb))["routing"]
    np.testing.assert_array_equal(used[valid], recorded["routing"][valid])
