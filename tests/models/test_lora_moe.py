"""LoRA on Qwen3-MoE: 'all-linear' resolves to what real PEFT adapts as nn.Linear on transformers 5's
Qwen3MoeForCausalLM (the attention), MLP names fail with one error, a fresh adapter leaves the logits
unchanged, PEFT loads our adapter directory with no missing or unexpected keys and computes our fp32
logits (and so does its merged model), and 8 expert-sharded devices compute one device's logits and
adapter gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl_llm import sharding
from jaxrl_llm.models import DecoderConfig, graphdef_and_abstract_params, init_params, load_params
from jaxrl_llm.models.config import PRESETS
from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.lora import (
    MOE_LORA_MODULES,
    LoraSpec,
    adapter_shardings,
    combine,
    init_adapters,
    merge_adapters,
    resolve_targets,
)
from jaxrl_llm.models.peft_io import WEIGHTS_NAME, load_peft, save_peft
from jaxrl_llm.models.safetensors_io import SafetensorsFile
from tests.hf_models import make_hf_model

peft = pytest.importorskip("peft")

IDS = np.array([[3, 17, 5, 9, 64, 2, 11, 7], [8, 1, 33, 4, 90, 12, 6, 5]], np.int32)


def _random_adapters(cfg, spec, seed=1, mesh=None):
    """Adapters with a non-zero lora_b (a trained adapter), so they change the logits."""
    leaves, tree = jax.tree.flatten(init_adapters(cfg, spec, seed=seed))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
    return out if mesh is None else jax.device_put(out, adapter_shardings(cfg, spec, mesh))


def _logits(cfg, params, spec=None):
    gd, _ = graphdef_and_abstract_params(cfg if spec is None else spec.apply(cfg))
    return np.asarray(nnx.merge(gd, params)(jnp.asarray(IDS)))


def test_all_linear_is_what_peft_adapts_as_linear_modules_and_mlp_names_fail():
    """Real PEFT on transformers 5's Qwen3-MoE (a sparse layer, a dense one): its 'all-linear' puts
    nn.Linear LoRA on q/k/v/o_proj only, and maps the router and the experts (v4's Linear names) to
    target_parameters, which we leave out (NOTES item 32)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1]))
    conf = peft.get_peft_model(hf, peft.LoraConfig(target_modules="all-linear", r=4)).peft_config["default"]
    cfg = PRESETS["tiny_moe"](mlp_only_layers=[1])
    assert set(conf.target_modules) == set(resolve_targets("all-linear", cfg=cfg)) == set(MOE_LORA_MODULES)
    assert set(conf.target_parameters) == {"gate.weight", "gate_up_proj", "down_proj"}
    assert resolve_targets(["q_proj", "v_proj"], cfg=cfg) == ("q_proj", "v_proj")
    for bad in (["q_proj", "gate_proj"], ["down_proj"]):
        with pytest.raises(ConfigError, match=r"model.target_modules: .*mixture-of-experts.*'all-linear'"):
            resolve_targets(bad, cfg=cfg)
    with pytest.raises(ConfigError, match="model.target_modules"):
        LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear")).apply(cfg)  # a dense model's targets


def test_peft_loads_our_moe_adapters_with_our_logits_fresh_ones_change_nothing(tmp_path):
    """A mixed MoE (a sparse and a dense layer): fresh adapters keep the base's logits; trained ones, saved
    as a PEFT directory, load onto transformers' Qwen3MoeForCausalLM with exactly PEFT's keys and give our
    fp32 logits, merged or not; our loader reads them back."""
    hf = make_hf_model(tmp_path / "base", family="qwen3_moe", head_dim=16, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    cfg = DecoderConfig.from_hf(tmp_path / "base")
    assert cfg.layer_stacks == {"layers": (0,), "dense_layers": (1,)}
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear", cfg=cfg))
    base = load_params(str(tmp_path / "base"), cfg)
    base_logits = _logits(cfg, base)
    np.testing.assert_array_equal(_logits(cfg, combine(base, init_adapters(cfg, spec, seed=1)), spec), base_logits)
    adapters = _random_adapters(cfg, spec)
    ours = _logits(cfg, combine(base, adapters), spec)
    assert np.abs(ours - base_logits).max() > 1e-2
    merged = merge_adapters(base, adapters, spec, jnp.float32)
    np.testing.assert_allclose(_logits(cfg, merged), ours, atol=1e-5, rtol=0)
    assert merged["model"]["layers"]["mlp"]["experts"]["gate_proj"] is base["model"]["layers"]["mlp"]["experts"][
        "gate_proj"]  # untouched: the same array

    save_peft(adapters, spec, tmp_path / "adapter", cfg, base_model=str(tmp_path / "base"))
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    expected = peft.utils.get_peft_model_state_dict(model)
    file = SafetensorsFile(tmp_path / "adapter" / WEIGHTS_NAME)
    assert sorted(file.names()) == sorted(expected)
    assert any(".layers.1.self_attn" in k for k in expected)  # the dense layer's attention too
    with torch.no_grad():
        theirs = model(torch.as_tensor(IDS, dtype=torch.long)).logits.float().numpy()
        np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5 * np.abs(ours).max())
        unloaded = model.merge_and_unload()(torch.as_tensor(IDS, dtype=torch.long)).logits.float().numpy()
        np.testing.assert_allclose(unloaded, ours, rtol=1e-5, atol=1e-5 * np.abs(ours).max())
    back = load_peft(str(tmp_path / "adapter"), cfg, spec)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, adapters)


def test_expert_sharded_lora_equals_one_device():
    """fsdp 2 x expert 4 with remat: the logits and the adapters' gradients of one device."""
    cfg = PRESETS["tiny_moe"](mlp_only_layers=[1])
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear", cfg=cfg))
    lcfg = spec.apply(cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(2, cfg.vocab_size, (8, 10)))
    lengths = jnp.asarray(rng.integers(4, 11, 8), jnp.int32)

    def make(remat):
        graphdef, _ = graphdef_and_abstract_params(lcfg.replace(remat=remat))

        def loss(adapters, base):
            logits = nnx.merge(graphdef, combine(base, adapters))(ids, lengths=lengths)
            return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    (_, ref_logits), ref_grads = make("none")(_random_adapters(cfg, spec), init_params(cfg, seed=2))
    mesh = sharding.make_mesh(1, 2, 1, expert=4)
    adapters, base = _random_adapters(cfg, spec, mesh=mesh), init_params(cfg, mesh=mesh, seed=2)
    with jax.set_mesh(mesh):
        (_, logits), grads = make("full")(adapters, base)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref_logits))))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads)
    assert float(jnp.max(jnp.abs(ref_grads["model"]["dense_layers"]["self_attn"]["q_proj"]["lora_b"]))) > 0
