"""Qwen3-MoE: logits and the load-balancing loss equal transformers', HF export reloads cleanly, the
grouped expert matmuls equal a float64 reference, greedy decoding equals transformers', and bad configs
are one clear error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl_llm import sharding
from jaxrl_llm.models import (
    PRESETS,
    ConfigError,
    DecoderConfig,
    graphdef_and_abstract_params,
    init_params,
    load_hf,
    save_hf,
    split_model,
)
from jaxrl_llm.models.moe import expert_parallel_experts, grouped_experts, route
from jaxrl_llm.rollout import JaxEngine, SamplingParams
from jaxrl_llm.trainer.metrics import veRL_flops
from tests.hf_models import make_hf_model

MOE = dict(family="qwen3_moe", head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
           norm_topk_prob=True)
CASES = {
    "top1_of_4_norm_off": dict(MOE, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False),
    "top8_of_8_norm_on_dense_layer": dict(MOE, num_experts_per_tok=8, num_hidden_layers=3, mlp_only_layers=[1]),
    "sparse_step2_tied_norm_off": dict(MOE, num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False,
                                       tie_word_embeddings=True),
}

# Qwen/Qwen3-30B-A3B's config.json (the parts that matter).
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     router_aux_loss_coef=0.001, tie_word_embeddings=False, bos_token_id=151643,
                     eos_token_id=151645)


def _rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _inputs(vocab, b=3, t=24, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, size=(b, t))
    mask = np.ones((b, t), np.int64)
    mask[1, :4] = 0  # left padding: the router loss must skip these tokens
    mask[2, :11] = 0
    ids[mask == 0] = 0
    return ids, mask, np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def _torch(model, ids, mask, pos):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos),
                    output_router_logits=True)
    return out.logits.float().numpy(), float(out.aux_loss)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_router_loss_match_transformers_then_export_reloads(tmp_path, case):
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "export"
    ref_model = make_hf_model(hf_dir, **CASES[case])
    ids, mask, pos = _inputs(ref_model.config.vocab_size)
    ref, ref_aux = _torch(ref_model, ids, mask, pos)

    model = load_hf(hf_dir, dtype="float32")
    cfg = model.cfg
    assert cfg.model_type == "qwen3_moe" and cfg.num_params() == ref_model.num_parameters()
    logits, aux = jax.jit(lambda i, m: model.logits_and_router_aux_loss(i, attention_mask=m))(ids, mask)
    valid = mask.astype(bool)
    assert _rel_err(np.asarray(logits)[valid], ref[valid]) <= 1e-5
    assert abs(float(aux) - ref_aux) <= 1e-5 * ref_aux

    save_hf(model, out_dir)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                                       output_loading_info=True)
    assert type(reloaded) is type(ref_model)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    again, again_aux = _torch(reloaded.eval(), ids, mask, pos)
    assert _rel_err(again[valid], ref[valid]) <= 1e-5 and again_aux == pytest.approx(ref_aux, rel=1e-6)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings"):
        assert getattr(reloaded.config, key) == getattr(ref_model.config, key), key


def test_released_config_presets_and_active_params():
    cfg = DecoderConfig.from_hf(QWEN3_30B_A3B)
    assert cfg == PRESETS["qwen3_30b_a3b"]()
    assert DecoderConfig.from_hf(cfg.to_hf()) == cfg
    # The model cards: 30.5B parameters, 3.3B activated; 235B and 22B.
    assert round(cfg.num_params() / 1e9, 1) == 30.5 and int(cfg.num_params(active=True) / 1e8) == 33
    big = PRESETS["qwen3_235b_a22b"]()
    assert round(big.num_params() / 1e9) == 235 and round(big.num_params(active=True) / 1e9) == 22
    # transformers 5 writes `num_local_experts` (its alias) in place of num_experts.
    alias = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert DecoderConfig.from_hf(alias).num_experts == 128
    # MFU counts active parameters: veRL's FLOPs with a sparse layer's MLP as k experts plus the router.
    d, layers, seq = 2048, 48, 1000
    attn_linear = d * (2 * 32 * 128 + 2 * 4 * 128)
    active = layers * (8 * 3 * d * 768 + d * 128 + attn_linear) + 2 * 151936 * d
    assert veRL_flops(cfg, np.array([seq])) == pytest.approx(6 * active * seq + 12 * seq**2 * 128 * 32 * layers)
    mixed = PRESETS["tiny_moe"](num_hidden_layers=5, mlp_only_layers=[1], decoder_sparse_step=1)
    assert mixed.layer_stacks == {"layers": (0, 2, 3, 4), "dense_layers": (1,)}
    assert mixed.layer_runs == (("layers", 0, 1), ("dense_layers", 0, 1), ("layers", 1, 4))


@pytest.mark.parametrize("fields,match", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    (dict(mlp_only_layers=[2]), r"mlp_only_layers has \[2\], outside the 2 layers"),
    (dict(moe_intermediate_size=0), r"moe_intermediate_size=0"),
    (dict(decoder_sparse_step=3), r"no sparse layer \(decoder_sparse_step=3"),
    (dict(model_type="qwen3"),
     r"num_experts=8, output_router_logits=False need a mixture-of-experts model_type \('qwen3_moe'"),
])
def test_bad_moe_config_is_one_error_naming_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        PRESETS["tiny_moe"](**fields)


def test_released_config_without_expert_width_names_the_key():
    raw = {k: v for k, v in QWEN3_30B_A3B.items() if k != "moe_intermediate_size"}
    with pytest.raises(ConfigError, match=r"config dict: missing field\(s\) \['moe_intermediate_size'\]"):
        DecoderConfig.from_hf(raw)


def test_grouped_experts_equal_a_float64_reference_values_and_grads():
    """ragged_dot over expert-sorted tokens against a per-token loop (values) and a dense all-experts
    einsum masked by the routing weights (gradients, both in JAX)."""
    rng = np.random.default_rng(0)
    n, d, e, i, k = 13, 16, 6, 8, 3
    x, router = rng.normal(size=(n, d)), rng.normal(size=(d, e))
    gate, up, down = (rng.normal(size=s) * 0.3 for s in ((e, d, i), (e, d, i), (e, i, d)))
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    _, w, idx = route(f32(x), f32(router), top_k=k, norm_topk_prob=True)
    w, idx = np.asarray(w, np.float64), np.asarray(idx)

    silu = lambda z: z / (1 + np.exp(-z))
    ref = np.zeros((n, d))
    for t in range(n):
        for j in range(k):
            ex = idx[t, j]
            ref[t] += w[t, j] * (silu(x[t] @ gate[ex]) * (x[t] @ up[ex])) @ down[ex]
    ours = np.asarray(grouped_experts(f32(x), f32(w), jnp.asarray(idx), f32(gate), f32(up), f32(down)))
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    dense_w = jnp.zeros((n, e)).at[jnp.arange(n)[:, None], idx].set(f32(w))  # [N, E], zero off the top-k

    def dense(x, gate, up, down):
        h = jax.nn.silu(jnp.einsum("nd,edi->nei", x, gate)) * jnp.einsum("nd,edi->nei", x, up)
        return jnp.einsum("nei,eid,ne->nd", h, down, dense_w)

    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))
    args = (f32(x), f32(gate), f32(up), f32(down))
    g_ours = jax.grad(loss(lambda x, g, u, dn: grouped_experts(x, f32(w), jnp.asarray(idx), g, u, dn)),
                      argnums=(0, 1, 2, 3))(*args)
    g_ref = jax.grad(loss(dense), argnums=(0, 1, 2, 3))(*args)
    for a, b in zip(g_ours, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))))


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42]]


def test_greedy_generation_equals_transformers(tmp_path):
    hf = make_hf_model(tmp_path, vocab_size=96, initializer_range=0.3, eos_token_id=7,
                       **dict(MOE, num_hidden_layers=3, mlp_only_layers=[1]))
    model = load_hf(tmp_path)
    engine = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", page_size=8)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=20))
    for i, prompt in enumerate(PROMPTS):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=7, pad_token_id=0,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        assert out.response_ids(i) == ref, f"prompt {i}"
        assert len(set(ref)) > 3  # not a degenerate repeat
    # On a mesh with an expert axis (train.mesh_expert) the sampler runs data-parallel over it.
    sharded = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", mesh=sharding.make_mesh(1, 2, 1, expert=4),
                        page_size=8)
    np.testing.assert_array_equal(sharded.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=20)).tokens,
                                  out.tokens)


def test_expert_sharded_with_remat_equals_one_device():
    """A sparse then a dense layer on 8 devices: fsdp 2 x expert 4 (two experts a device) with remat
    'full' gives the logits, router loss and gradients of one device without remat. The 8 rows split
    over the expert axis too, so tokens are gathered, then reduce-scattered."""
    cfg = PRESETS["tiny_moe"](mlp_only_layers=[1])
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(2, cfg.vocab_size, (8, 10)))
    lengths = jnp.asarray(rng.integers(4, 11, 8), jnp.int32)

    def make(remat):
        graphdef, _ = graphdef_and_abstract_params(cfg.replace(remat=remat))

        def loss(params):
            logits, aux = nnx.merge(graphdef, params).logits_and_router_aux_loss(ids, lengths=lengths)
            return jnp.mean(jax.nn.logsumexp(logits, -1)) + 0.1 * aux, (logits, aux)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    (ref, (ref_logits, ref_aux)), ref_grads = make("none")(init_params(cfg, seed=2))
    mesh = sharding.make_mesh(1, 2, 1, expert=4)
    params = init_params(cfg, mesh=mesh, seed=2)
    gate = params["model"]["layers"]["mlp"]["experts"]["gate_proj"]  # [L, E, D, I]
    assert gate.sharding.shard_shape(gate.shape)[1] == cfg.num_experts // 4
    with jax.set_mesh(mesh):
        (val, (logits, aux)), grads = make("full")(params)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref_logits))))
    assert float(aux) == pytest.approx(float(ref_aux), rel=1e-6) and float(val) == pytest.approx(float(ref), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads)
    assert float(jnp.max(jnp.abs(ref_grads["model"]["layers"]["mlp"]["gate"]["kernel"]))) > 0  # the router learns


@pytest.mark.parametrize("rows", [16, 3], ids=["tokens_split_gather_scatter", "tokens_replicated_psum"])
def test_expert_parallel_experts_equal_grouped_experts(rows):
    """Both dispatch paths: 16 tokens split over fsdp 2 x expert 4; 3 tokens (not divisible) replicated."""
    rng = np.random.default_rng(1)
    e, d, i, k = 8, 16, 8, 2
    x, router = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32), jnp.asarray(rng.normal(size=(d, e)), jnp.float32)
    gate, up, down = (jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((e, d, i), (e, d, i), (e, i, d)))
    _, w, idx = route(x, router, top_k=k, norm_topk_prob=False)
    ref = grouped_experts(x, w, idx, gate, up, down)
    mesh = sharding.make_mesh(1, 2, 1, expert=4)
    with jax.set_mesh(mesh):
        out = jax.jit(expert_parallel_experts)(x, w, idx, gate, up, down)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
