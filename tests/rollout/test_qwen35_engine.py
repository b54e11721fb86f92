"""The paged engine on Qwen3.5 (linear-attention layers with state slots beside KV pages): greedy tokens equal
transformers' generate, under preemption and with the samples of a prompt forking from its snapshot; sampled
log-probs equal the teacher-forced forward; chunked prefill of long prompts; the memory budget's state slots."""

import jax
import numpy as np
import pytest
import torch

from jaxrl_llm.models import DecoderConfig, init_params, load_hf, split_model
from jaxrl_llm.rollout import JaxEngine, RolloutError, SamplingParams, jax_engine, paged_decode
from jaxrl_llm.trainer.config import RolloutConfig
from tests.hf_models import make_qwen35_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
           [40, 41, 42]]


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text"])
def hf_and_model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf = make_qwen35_model(d, family=request.param, vocab_size=96, initializer_range=0.3, eos_token_id=7)
    return hf, load_hf(d)


def _hf_greedy(hf, prompt, max_new):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=7,
                      pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_generate_with_preemption(hf_and_model):
    """A pool of a few pages and a handful of state slots: rows wait, are preempted and recompute their state
    from position 0, and still give transformers' greedy tokens; chunked prefill splits the long prompt."""
    hf, model = hf_and_model
    params = split_model(model)[1]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    refs = [_hf_greedy(hf, p, 24) for p in PROMPTS]
    assert all(len(set(r)) > 3 for r in refs)  # not a degenerate repeat
    free = JaxEngine(model.cfg, params, dtype="float32", page_size=4)
    out = free.generate(PROMPTS, sp)
    for i in range(len(PROMPTS)):
        assert out.response_ids(i) == refs[i], f"prompt {i}"
    assert free.last_stats["state_slots"] > 0 and free.last_stats["preemptions"] == 0

    probe = JaxEngine(model.cfg, params, dtype="float32", page_size=2)
    tight = JaxEngine(model.cfg, params, dtype="float32", page_size=2, max_num_seqs=3, max_segment=3,
                      max_num_batched_tokens=16,
                      kv_cache_memory_bytes=probe.page_bytes() * 23 + probe.state_bytes() * 6)
    out = tight.generate(PROMPTS, sp)
    assert tight.last_stats["preemptions"] > 0
    for i in range(len(PROMPTS)):
        assert out.response_ids(i) == refs[i], f"prompt {i} (tight)"


def test_samples_fork_from_the_prompts_snapshot_and_logprobs_equal_the_forward(hf_and_model):
    """n samples of a prompt: the first prefills it and writes its state to a snapshot slot, the others share
    its pages and copy the snapshot. Greedy samples of one prompt are then identical, and sampled tokens'
    log-probs equal the model's teacher-forced forward."""
    hf, model = hf_and_model
    params = split_model(model)[1]
    engine = JaxEngine(model.cfg, params, dtype="float32", page_size=4)
    greedy = engine.generate(PROMPTS, SamplingParams(n=3, temperature=0.0, max_new_tokens=12))
    stats = engine.last_stats  # the others copied its state (a sibling whose first sample finished prefills)
    assert stats["shared_pages"] > 0 and stats["state_copies"] >= len(PROMPTS)
    assert stats["prefill_tokens"] < 2 * sum(len(p) - 1 for p in PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        ref = _hf_greedy(hf, prompt, 12)
        for j in range(3):
            assert greedy.response_ids(3 * i + j) == ref, f"prompt {i} sample {j}"

    temp = 0.8
    out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=temp, max_new_tokens=16, seed=4))
    seqs = [PROMPTS[out.prompt_index[r]] + out.response_ids(r) for r in range(len(out))]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for r, seq in enumerate(seqs):
        ids[r, : len(seq)] = seq
    logp = np.asarray(jax.jit(lambda i: jax.nn.log_softmax(model(i) / temp, axis=-1))(ids))
    for r in range(len(out)):  # the wide init's logits (tens) and the chunked vs recurrent rule: fp32 rounding ~5e-5
        prompt, resp = PROMPTS[out.prompt_index[r]], out.response_ids(r)
        pos = np.arange(len(prompt) - 1, len(prompt) + len(resp) - 1)
        np.testing.assert_allclose(out.logprobs[r, : len(resp)], logp[r, pos, np.asarray(resp)], atol=1e-4, rtol=1e-4)


def test_state_slots_come_out_of_the_budget_and_bound_the_rows(hf_and_model):
    """With an explicit byte budget, the state slots and the pages share it: the slot cap is what fits, and a
    request with more rows than slots runs in waves."""
    _, model = hf_and_model
    params = split_model(model)[1]
    probe = JaxEngine(model.cfg, params, dtype="float32", page_size=4)
    budget = 6 * (probe.state_bytes() * 1.25 + 4 * probe.page_bytes())
    eng = JaxEngine(model.cfg, params, dtype="float32", page_size=4, kv_cache_memory_bytes=int(budget),
                    max_model_len=64)
    out = eng.generate(PROMPTS * 3, SamplingParams(n=2, temperature=0.0, max_new_tokens=8, ignore_eos=True))
    stats = eng.last_stats
    assert stats["slot_cap"] < 24 and stats["state_slots"] == stats["slot_cap"] + max(1, stats["slot_cap"] // 4) + 1
    assert stats["kv_bytes"] + stats["state_slots"] * probe.state_bytes() <= budget
    assert len(out) == 24 and all(out.lengths == 8)


def test_state_forks_take_the_narrowest_copy_width_and_every_width_is_built_ahead():
    """A prompt's siblings copy its state snapshot (24 MiB a pair at Qwen3.5-9B) in a copy program whose width is
    the narrowest of a ladder that covers the round's pairs, not the slot cap's power of two whatever the round
    copies (1,024 pairs at the 9B's default: 48 GiB moved a call); every width is built ahead with the other
    programs, so a later round's wider call compiles nothing."""
    cfg = DecoderConfig.tiny_qwen35(dtype="float32")
    eng = JaxEngine(cfg, init_params(cfg, seed=0), dtype="float32", page_size=4, max_num_seqs=64,
                    max_prompt_length=16, max_model_len=32, warm_programs=True)
    eng.generate([[5, 6, 7, 8]] * 48, SamplingParams(temperature=0.0, max_new_tokens=4))  # builds: no forks (n=1)
    assert eng.last_stats["state_copies"] == 0 and eng.last_stats["programs_compiled"] > 0
    assert eng.ladders.copy_widths == [16, 32, 64]
    copies = lambda: sorted(key[1][1] for key in eng._base.programs if key[0] == "_copy")
    widths = []
    for prompts, n in ((PROMPTS[:2], 3), ([[5, 6, 7, 8]] * 12, 4)):  # 4 forks in one round, then 36
        eng.generate(prompts, SamplingParams(n=n, temperature=0.0, max_new_tokens=4))
        assert eng.last_stats["state_copies"] == len(prompts) * (n - 1)
        assert eng.last_stats["programs_compiled"] == 0  # built ahead by the first call
        widths.append(copies())
    assert widths == [[16], [16, 64]]  # without the ladder: [64] for both


def test_each_linear_layers_state_copy_waits_for_the_previous_layers():
    """Nothing else orders the linear layers' copies, so all their gathered rows could be alive at once (24 x 1 GiB
    at the 9B's widest call). XLA's CPU pipeline drops optimization barriers before scheduling, so the memory this
    saves shows only on a GPU (benchmarks/diag/copy_memory.py); here: the copy program chains the layers."""
    cfg = DecoderConfig.tiny_qwen35(dtype="float32")
    eng = JaxEngine(cfg, None, dtype="float32", page_size=4, max_num_seqs=8, max_model_len=32)
    spec, base = eng._spec(SamplingParams(), eng.decode_attention), eng._base  # the copy takes no weights
    args = eng._abstract((eng.abstract_pool(spec, 64, 11, base), np.zeros((4, 16), np.int32)), base.mesh)
    with jax.set_mesh(base.mesh):
        text = JaxEngine._copy.lower(eng, *args).as_text()
    assert len(spec.linear_layers) > 1 and text.count("stablehlo.optimization_barrier") == len(spec.linear_layers) - 1


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_in_place_state_update_gives_the_scatters_tokens_and_copies_no_pool(impl, monkeypatch):
    """state_update='in_place': the decode kernel writes each row's new state into its slot (2 passes over a state
    a step, not 4). The tokens and log-probs are the scatter's, and the compiled decode programs hold no copy of a
    layer's state pool (XLA copies an aliased buffer that is read after the kernel). On the CPU: the jnp form
    ('auto') and the Pallas kernel in its interpreter; an earlier in-place form passed this check on the CPU too
    and still made XLA copy the pool on an H100 (benchmarks/NOTES.md item 48), so the GPU has the last word."""
    monkeypatch.setattr(paged_decode, "GDN_DECODE_IMPL", impl)
    cfg = DecoderConfig.tiny_qwen35(dtype="float32")
    params = init_params(cfg, seed=0)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    outs, copies = [], []
    for mode in ("scatter", "in_place"):
        eng = JaxEngine(cfg, params, dtype="float32", page_size=4, max_num_seqs=8, max_model_len=32,
                        state_update=mode)
        outs.append(eng.generate(PROMPTS, sp))
        pool = eng.abstract_pool(eng._spec(sp, eng.decode_attention), eng._base.num_pages, eng._base.state_slots,
                                 eng._base)
        rec = next(entry[1] for entry in pool if entry[0].ndim == 3)  # a linear layer's [Ns, Hv, Dk, Dv]
        shape = f"f32[{','.join(map(str, rec.shape))}]{{"
        texts = [p.as_text() for (name, _, _), p in eng._base.programs.items() if name == "_decode"]
        assert texts
        copies.append(sum(line.split("= ", 1)[-1].startswith(shape) and " copy(" in line
                          for text in texts for line in text.splitlines()))
    np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
    np.testing.assert_allclose(outs[1].logprobs, outs[0].logprobs, rtol=1e-6, atol=1e-6)
    assert copies == [0, 0]


def test_the_dense_engine_refuses_a_linear_attention_model(hf_and_model):
    _, model = hf_and_model
    with pytest.raises(RolloutError, match="rollout.kv_cache = 'paged'"):
        jax_engine.make_jax_engine(model.cfg, split_model(model)[1], None, rollout=RolloutConfig(kv_cache="dense"),
                                   max_prompt_length=32)


def test_a_frozen_bases_experts_are_read_in_place(hf_and_model, monkeypatch):
    """Experts already in the engine's dtype and layout are not copied: the engine holds the caller's [L, E, ...]
    arrays and its programs index the layer in them, with the tokens of an engine that copies them."""
    _, model = hf_and_model
    if not model.cfg.is_moe:
        pytest.skip("a dense model has no experts")
    params = split_model(model)[1]
    engine = JaxEngine(model.cfg, params, dtype="float32", page_size=4)
    pointer = lambda a: a.addressable_shards[0].data.unsafe_buffer_pointer()
    for stack in ("layers", "linear_layers"):
        held = engine.params["experts"][stack]["gate_proj"]
        assert pointer(held) == pointer(params["model"][stack]["mlp"]["experts"]["gate_proj"])  # the same buffer
    assert all("expert_gate_w" not in lp for lp in engine.params["layers"])
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=1)
    shared = engine.generate(PROMPTS, sp)
    monkeypatch.setattr(JaxEngine, "shared_experts", lambda self, p: {})
    copied = JaxEngine(model.cfg, params, dtype="float32", page_size=4)
    assert "experts" not in copied.params
    np.testing.assert_array_equal(copied.generate(PROMPTS, sp).tokens, shared.tokens)


def test_the_memory_report_leaves_out_the_experts_it_reads_in_place(hf_and_model, monkeypatch):
    """The experts the engine reads in place are the trainer's buffers, which the memory check already holds among
    the trainer's states: the engine's report leaves them out (it counted them twice, and refused Qwen3.5-35B-A3B's
    LoRA step on an H200 at 174.8 GB where it needs about 110). An engine that copies them reports them."""
    _, model = hf_and_model
    if not model.cfg.is_moe:
        pytest.skip("a dense model has no experts")
    params = split_model(model)[1]
    kw = dict(dtype="float32", page_size=4, max_num_seqs=8, max_prompt_length=16, max_model_len=32)
    shared = JaxEngine(model.cfg, params, **kw)
    experts = sum(x.nbytes for x in jax.tree.leaves(shared.params["experts"]))
    own = sum(x.nbytes for x in jax.tree.leaves({k: v for k, v in shared.params.items() if k != "experts"}))
    in_place = dict(shared.memory_report())
    monkeypatch.setattr(JaxEngine, "shared_experts", lambda self, p: {})
    copied = dict(JaxEngine(model.cfg, params, **kw).memory_report())
    assert set(in_place) == set(copied) == {"decode", "prefill 16", "prefill 32 (continuation)"}, in_place
    for name, need in in_place.items():
        assert own < need < copied[name] - 0.9 * experts, (name, need, copied[name], own, experts)


def test_every_pool_write_takes_its_indices_as_unique_and_a_prefill_reads_a_layers_slots_after_its_input():
    """Only the scratch page or slot repeats among a pool write's indices (finished rows, padding and unused copy
    pairs write there; nothing reads it), so every scatter into the pool says its indices are unique: XLA's GPU
    scatter otherwise serialises the writes (a Qwen3.5-9B conv window's: 0.93 -> 0.031 ms a layer). And a prefill's
    linear layer gathers its rows' states only once its input exists (a barrier a layer beside the write's): the
    gathers read only the pool, so else XLA may gather every layer's at the start. The memory that saves shows only
    on a GPU (benchmarks/diag/prefill_memory.py); here: the programs' text."""
    cfg = DecoderConfig.tiny_qwen35(dtype="float32")
    eng = JaxEngine(cfg, init_params(cfg, seed=0), dtype="float32", page_size=4, max_num_seqs=8, max_model_len=32)
    spec, base = eng._spec(SamplingParams(), eng.decode_attention), eng._base
    pool = eng.abstract_pool(spec, 64, 11, base)
    w = 8
    programs = {"_prefill": ((base.params, pool, np.zeros((4, 16 + w + paged_decode.PREFILL_COLS), np.int32)),
                             {"spec": spec, "length": 16}),
                "_decode": ((base.params, pool, np.zeros((4, w + paged_decode.DECODE_COLS), np.int32)),
                            {"spec": spec}),
                "_copy": ((pool, np.zeros((4, 16), np.int32)), {})}
    texts = {}
    for name, (args, static) in programs.items():
        with jax.set_mesh(base.mesh):
            texts[name] = getattr(JaxEngine, name).lower(eng, *eng._abstract(args, base.mesh), **static).as_text()
    scatters = {name: [line for line in text.splitlines() if '"stablehlo.scatter"' in line]
                for name, text in texts.items()}
    # prefill: each attention layer's K and V, each linear layer's conv and state into slot and snapshot
    linear, attention = len(spec.linear_layers), spec.num_layers - len(spec.linear_layers)
    assert len(scatters["_prefill"]) == 2 * attention + 4 * linear
    assert len(scatters["_copy"]) == 2 * attention + 2 * linear and scatters["_decode"]
    assert all("unique_indices = true" in line for lines in scatters.values() for line in lines), scatters
    assert texts["_prefill"].count("stablehlo.optimization_barrier") == 2 * linear
