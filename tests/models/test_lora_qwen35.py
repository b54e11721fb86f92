"""LoRA on Qwen3.5 and Qwen3.5-MoE: 'all-linear' puts adapters on exactly the modules real PEFT's 'all-linear' puts
them on in transformers 5.19 (the Gated DeltaNet's projections, the gated attention, the dense MLP or the shared
expert and its gate), a name the model lacks is one error, merging equals running the adapters, PEFT loads our
adapter directory with exactly its keys and computes our fp32 logits (merged or not), and adapters PEFT saved load
into ours and compute PEFT's logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl_llm.models import DecoderConfig, graphdef_and_abstract_params, load_params
from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.hf_table import get_path
from jaxrl_llm.models.lora import (
    LoraSpec,
    adapter_sites,
    combine,
    init_adapters,
    merge_adapters,
    resolve_targets,
)
from jaxrl_llm.models.peft_io import WEIGHTS_NAME, load_peft, peft_key, save_peft
from jaxrl_llm.models.safetensors_io import SafetensorsFile
from tests.hf_models import make_qwen35_model

peft = pytest.importorskip("peft")

IDS = np.array([[3, 17, 5, 9, 64, 2, 11, 7, 40, 41, 42], [8, 1, 33, 4, 90, 12, 6, 5, 100, 2, 3]], np.int32)
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text"]
# What PEFT 0.21's 'all-linear' targets on transformers 5.19's Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM.
DENSE_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                    "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def _random_adapters(cfg, spec, seed=1):
    """Adapters with a non-zero lora_b (a trained adapter), so they change the logits."""
    leaves, tree = jax.tree.flatten(init_adapters(cfg, spec, seed=seed))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


@functools.cache
def _forward(cfg):
    gd, _ = graphdef_and_abstract_params(cfg)
    return jax.jit(lambda p: nnx.merge(gd, p)(jnp.asarray(IDS)))


def _logits(cfg, params, spec=None):
    return np.asarray(_forward(cfg if spec is None else spec.apply(cfg))(params))


def _rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _module_name(peft_name: str) -> str:
    """`layers.{i}.<module path>` of a PEFT tensor's name."""
    return "layers." + peft_name.split(".layers.", 1)[1].rsplit(".lora_A", 1)[0]


def _hf_names(cfg, spec):
    """`layers.{i}.<module path>` of every module our adapters sit on."""
    return {_module_name(peft_key(path, i, "lora_a")) for stack, _, path in adapter_sites(cfg, spec)
            for i in cfg.layer_stacks[stack]}


@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_adapts_the_modules_pefts_all_linear_adapts(family):
    hf = make_qwen35_model(family=family)
    model = peft.get_peft_model(hf, peft.LoraConfig(target_modules="all-linear", r=4))
    conf = model.peft_config["default"]
    theirs = {_module_name(n) for n, _ in model.named_parameters() if ".lora_A." in n}
    cfg = DecoderConfig.from_hf(hf.config.to_dict())
    targets = resolve_targets("all-linear", cfg=cfg)
    want = DENSE_ALL_LINEAR + (("shared_expert_gate",) if family == "qwen3_5_moe_text" else ())
    assert set(targets) == set(conf.target_modules) == set(want) and not conf.target_parameters
    assert _hf_names(cfg, LoraSpec(rank=4, alpha=8.0, targets=targets)) == theirs
    if family == "qwen3_5_moe_text":  # gate_proj is the shared expert's; the router and the experts get none
        assert "layers.0.mlp.shared_expert.gate_proj" in theirs and not any(".experts" in n for n in theirs)


def test_a_target_the_model_lacks_is_one_error_naming_the_key():
    dense, moe = DecoderConfig.tiny_qwen35(), DecoderConfig.tiny_qwen35_moe()
    assert resolve_targets(["in_proj_qkv", "out_proj"], cfg=dense) == ("in_proj_qkv", "out_proj")
    assert resolve_targets("all-linear", ("shared_expert_gate", "in_proj_b"), cfg=moe) == tuple(
        n for n in DENSE_ALL_LINEAR if n != "in_proj_b")
    with pytest.raises(ConfigError, match=r"model.target_modules: \['shared_expert_gate'\] are not linear modules "
                                          r"of this model \(model_type 'qwen3_5_text'\)"):
        resolve_targets(["q_proj", "shared_expert_gate"], cfg=dense)
    with pytest.raises(ConfigError, match=r"model.target_modules: \['in_proj_qkv'\] are not linear modules .*'qwen2'"):
        resolve_targets(["in_proj_qkv"], cfg=DecoderConfig.tiny())
    with pytest.raises(ConfigError, match=r"model.target_modules: unknown module name\(s\) \['gate'\]"):
        resolve_targets(["gate"], cfg=moe)  # the router is no nn.Linear in transformers either
    with pytest.raises(ConfigError, match=r"model.target_modules: .*not linear modules"):
        LoraSpec(rank=4, alpha=8.0, targets=("in_proj_z",)).apply(DecoderConfig.tiny())


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_our_adapters_computes_our_logits_and_ours_load_back(tmp_path, family):
    """Fresh adapters keep the base's logits; trained ones merged equal them run, kernel for kernel
    (W + A B alpha / r); saved as a PEFT directory they load onto transformers' model with exactly PEFT's keys and
    give our fp32 logits, merged or not; our loader reads them back bit for bit."""
    hf = make_qwen35_model(tmp_path / "base", family=family)
    cfg = DecoderConfig.from_hf(tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear", cfg=cfg))
    base = load_params(str(tmp_path / "base"), cfg)
    base_logits = _logits(cfg, base)
    # Two programs (with the zero adapters' dots and without): equal to fp32 rounding, which depends on how XLA fuses
    # them (bit for bit with its CPU backend's MLIR emitters, 1.5e-7 apart with the legacy ones conftest picks).
    np.testing.assert_allclose(_logits(cfg, combine(base, init_adapters(cfg, spec, seed=1)), spec), base_logits,
                               rtol=0, atol=1e-6)
    adapters = _random_adapters(cfg, spec)
    ours = _logits(cfg, combine(base, adapters), spec)
    assert _rel_err(ours, base_logits) > 1e-2
    merged = merge_adapters(base, adapters, spec, jnp.float32)
    for _, _, path in adapter_sites(cfg, spec):
        ad = get_path(adapters, path)
        want = (np.asarray(get_path(base, path + ("kernel",)), np.float64) + spec.scale * np.einsum(
            "lir,lro->lio", np.asarray(ad["lora_a"], np.float64), np.asarray(ad["lora_b"], np.float64)))
        np.testing.assert_allclose(np.asarray(get_path(merged, path + ("kernel",))), want, rtol=1e-6, atol=1e-7)
    assert _rel_err(_logits(cfg, merged), ours) <= 1e-5

    save_peft(adapters, spec, tmp_path / "adapter", cfg, base_model=str(tmp_path / "base"))
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    expected = peft.utils.get_peft_model_state_dict(model)
    file = SafetensorsFile(tmp_path / "adapter" / WEIGHTS_NAME)
    assert sorted(file.names()) == sorted(expected)
    assert all(tuple(expected[k].shape) == file.shape(k) for k in expected)
    with torch.no_grad():
        theirs = model(torch.as_tensor(IDS, dtype=torch.long)).logits.float().numpy()
        assert _rel_err(ours, theirs) <= 1e-5
        unloaded = model.merge_and_unload()(torch.as_tensor(IDS, dtype=torch.long)).logits.float().numpy()
    assert _rel_err(ours, unloaded) <= 1e-5
    back = load_peft(str(tmp_path / "adapter"), cfg, spec)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, adapters)


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_peft_saved_load_into_ours_with_pefts_logits(tmp_path, family):
    """A PEFT adapter trained on transformers' model ('all-linear', its lora_B made non-zero) and saved by PEFT
    loads into ours and computes PEFT's logits."""
    hf = make_qwen35_model(tmp_path / "base", family=family)
    model = peft.get_peft_model(hf, peft.LoraConfig(target_modules="all-linear", r=4, lora_alpha=8,
                                                    lora_dropout=0.0)).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
        theirs = model(torch.as_tensor(IDS, dtype=torch.long)).logits.float().numpy()
    model.save_pretrained(tmp_path / "adapter")
    cfg = DecoderConfig.from_hf(tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear", cfg=cfg))
    adapters = load_peft(str(tmp_path / "adapter"), cfg, spec)
    ours = _logits(cfg, combine(load_params(str(tmp_path / "base"), cfg), adapters), spec)
    assert _rel_err(ours, theirs) <= 1e-5


def test_adapters_of_a_vision_language_checkpoint_load_onto_it(tmp_path):
    """A released Qwen3.5 is `Qwen3_5ForConditionalGeneration`: adapters exported against it carry its
    `model.language_model.` prefix, PEFT loads them onto it with exactly its keys and our logits, and ours read them
    back."""
    text = make_qwen35_model().config.to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    vl = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).eval().float()
    vl.save_pretrained(tmp_path / "base")
    cfg = DecoderConfig.from_hf(tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets(["q_proj", "in_proj_qkv", "out_proj", "down_proj"],
                                                               cfg=cfg))
    adapters = _random_adapters(cfg, spec)
    ours = _logits(cfg, combine(load_params(str(tmp_path / "base"), cfg), adapters), spec)
    save_peft(adapters, spec, tmp_path / "adapter", cfg, base_model=str(tmp_path / "base"))
    names = SafetensorsFile(tmp_path / "adapter" / WEIGHTS_NAME).names()
    assert all(n.startswith("base_model.model.model.language_model.layers.") for n in names)
    model = peft.PeftModel.from_pretrained(vl, tmp_path / "adapter").eval()
    assert sorted(peft.utils.get_peft_model_state_dict(model)) == sorted(names)  # none on the vision tower
    with torch.no_grad():
        theirs = model(torch.as_tensor(IDS, dtype=torch.long)).logits.float().numpy()
    assert _rel_err(ours, theirs) <= 1e-5
    back = load_peft(str(tmp_path / "adapter"), cfg, spec)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, adapters)


def test_a_critics_adapters_and_value_head_load_onto_transformers_value_model(tmp_path):
    """A LoRA critic of a Qwen3.5 exports as a TOKEN_CLS adapter under the value model's `model.language_model.`
    layers (transformers' Qwen3_5ForTokenClassification wraps the language model), which PEFT loads with exactly its
    keys and our values."""
    text = make_qwen35_model().config.to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(1)
    hf = transformers.Qwen3_5ForTokenClassification(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, num_labels=1)).eval().float()
    hf.save_pretrained(tmp_path / "base")
    cfg = DecoderConfig.from_hf(tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear", cfg=cfg))
    base = load_params(str(tmp_path / "base"), cfg, critic=True)
    adapters = _random_adapters(cfg, spec)
    head = jax.tree.map(lambda x: x + 0.5, base["score"])  # a trained head
    save_peft(adapters, spec, tmp_path / "adapter", cfg, base_model=str(tmp_path / "base"), head=head)
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    names = SafetensorsFile(tmp_path / "adapter" / WEIGHTS_NAME).names()
    assert sorted(peft.utils.get_peft_model_state_dict(model)) == sorted(names)
    gd, _ = graphdef_and_abstract_params(spec.apply(cfg), critic=True)
    ours = np.asarray(nnx.merge(gd, combine(base, adapters, {"score": head}))(jnp.asarray(IDS)))  # [B, T]
    with torch.no_grad():
        theirs = model(torch.as_tensor(IDS, dtype=torch.long)).logits[..., 0].numpy()
    assert _rel_err(ours, theirs) <= 1e-5
