"""LoRA on the decoder: a fresh adapter changes nothing, merging equals running the adapters, PEFT loads
our adapter directory with no missing or unexpected keys and computes our logits (and so does its
merge_and_unload), our loader reads it back, and bad settings fail with one error naming the key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl_llm.models import DecoderConfig, graphdef_and_abstract_params, init_params, load_params
from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.lora import (
    LORA_MODULES,
    LoraSpec,
    adapter_sites,
    check_settings,
    combine,
    init_adapters,
    merge_adapters,
    resolve_targets,
)
from jaxrl_llm.models.peft_io import WEIGHTS_NAME, load_peft, peft_key, save_peft
from jaxrl_llm.models.safetensors_io import SafetensorsFile
from tests.hf_models import make_hf_model

peft = pytest.importorskip("peft")

IDS = np.array([[3, 17, 5, 9, 64, 2, 11, 7], [8, 1, 33, 4, 90, 12, 6, 5]], np.int32)


def _random_adapters(cfg, spec, seed=1):
    """Adapters with a non-zero lora_b (a trained adapter), so they change the logits."""
    leaves, tree = jax.tree.flatten(init_adapters(cfg, spec, seed=seed))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def _logits(cfg, params, spec=None):
    gd, _ = graphdef_and_abstract_params(cfg if spec is None else spec.apply(cfg))
    return np.asarray(nnx.merge(gd, params)(jnp.asarray(IDS)))


def test_fresh_adapters_leave_the_logits_unchanged_and_merging_equals_running_them():
    cfg = DecoderConfig.tiny()
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear"))
    base = init_params(cfg, seed=0)
    fresh = init_adapters(cfg, spec, seed=1)
    assert all(not np.any(np.asarray(b["lora_b"])) for b in jax.tree.leaves(
        fresh, is_leaf=lambda x: isinstance(x, dict) and "lora_b" in x))
    np.testing.assert_array_equal(_logits(cfg, combine(base, fresh), spec), _logits(cfg, base))
    trained = _random_adapters(cfg, spec)
    with_adapters = _logits(cfg, combine(base, trained), spec)
    assert np.abs(with_adapters - _logits(cfg, base)).max() > 1e-2
    np.testing.assert_allclose(_logits(cfg, merge_adapters(base, trained, spec, jnp.float32)), with_adapters,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,targets", [("qwen2", "all-linear"), ("llama", ("q_proj", "v_proj", "down_proj"))])
def test_peft_loads_our_adapters_and_computes_our_logits(tmp_path, family, targets):
    hf = make_hf_model(tmp_path / "base", family=family)
    cfg = DecoderConfig.from_hf(tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets(targets))
    base = load_params(str(tmp_path / "base"), cfg)
    adapters = _random_adapters(cfg, spec)
    save_peft(adapters, spec, tmp_path / "adapter", cfg, base_model=str(tmp_path / "base"))

    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    expected = peft.utils.get_peft_model_state_dict(model)  # the keys and shapes PEFT saves for this config
    ours = SafetensorsFile(tmp_path / "adapter" / WEIGHTS_NAME)
    assert sorted(expected) == sorted(ours.names())
    assert all(tuple(expected[k].shape) == ours.shape(k) for k in expected)
    result = model.load_adapter(tmp_path / "adapter", adapter_name="again")
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k and ".again." in k]

    ours_logits = _logits(cfg, combine(base, adapters), spec)
    with torch.no_grad():
        theirs = model(torch.from_numpy(IDS).long()).logits.numpy()
        np.testing.assert_allclose(theirs, ours_logits, atol=1e-5, rtol=0)
        merged = model.merge_and_unload()(torch.from_numpy(IDS).long()).logits.numpy()
    np.testing.assert_allclose(merged, ours_logits, atol=1e-5, rtol=0)

    back = load_peft(str(tmp_path / "adapter"), cfg, spec)
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, adapters))
    with pytest.raises(ConfigError, match=r"model.lora_rank=8 .* set model.lora_rank = 4"):
        load_peft(str(tmp_path / "adapter"), cfg, LoraSpec(rank=8, alpha=8.0, targets=spec.targets))
    other = tuple(n for n in LORA_MODULES if n not in spec.targets) or ("q_proj",)
    with pytest.raises(ConfigError, match="model.target_modules"):
        load_peft(str(tmp_path / "adapter"), cfg, LoraSpec(rank=4, alpha=8.0, targets=other))


def test_adapter_gradients_equal_pefts(tmp_path):
    """The trainer's update sees PEFT's gradients: d(sum of weighted logits)/d(lora_A, lora_B) through our model
    equals torch autograd through PeftModel (scale alpha / r, no dropout, the base frozen), module by module."""
    hf = make_hf_model(tmp_path / "base", family="qwen2")
    cfg = DecoderConfig.from_hf(tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear"))
    base = load_params(str(tmp_path / "base"), cfg)
    adapters = _random_adapters(cfg, spec)
    save_peft(adapters, spec, tmp_path / "adapter", cfg, base_model=str(tmp_path / "base"))
    weights = np.random.default_rng(0).normal(size=(*IDS.shape, cfg.vocab_size)).astype(np.float32)

    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).eval()
    (model(torch.from_numpy(IDS).long()).logits * torch.from_numpy(weights)).sum().backward()
    theirs = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    gd, _ = graphdef_and_abstract_params(spec.apply(cfg))
    ours = jax.grad(lambda a: jnp.sum(nnx.merge(gd, combine(base, a))(jnp.asarray(IDS)) * weights))(adapters)

    assert len(theirs) == 2 * len(spec.targets) * cfg.num_hidden_layers  # only the adapters get gradients
    for stack, name, path in adapter_sites(cfg, spec):
        node = ours
        for k in path:
            node = node[k]
        for leaf in ("lora_a", "lora_b"):
            for slot, layer in enumerate(cfg.layer_stacks[stack]):
                want = theirs[peft_key(path, layer, leaf).replace(".weight", ".default.weight")]
                got = np.asarray(node[leaf][slot]).T
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("args,match", [
    ((-1, 16, "all-linear", (), None), r"model.lora_rank: -1; use 0"),
    ((8, 16, ("q_proj", "qproj"), (), None), r"model.target_modules: unknown module name\(s\) \['qproj'\]"),
    ((8, 16, "all", (), None), r"model.target_modules: 'all'; use 'all-linear'"),
    ((8, 16, "all-linear", ("lm_head",), None), r"model.exclude_modules: unknown module name\(s\) \['lm_head'\]"),
    ((8, 16, ("q_proj",), ("q_proj",), None), "leaves no module to adapt"),
    ((8, 0, "all-linear", (), None), "model.lora_alpha: 0; need > 0"),
    ((0, 16, "all-linear", (), "/nonexistent"), "model.lora_adapter_path: an adapter needs LoRA on"),
    ((8, 16, "all-linear", (), "/nonexistent"), "model.lora_adapter_path: '/nonexistent' is not a PEFT adapter"),
    ((0, 16, ("q_proj",), (), None), r"model.target_modules is set but model.lora_rank is 0, which trains every "
                                      r"weight \(full fine-tuning\); set model.lora_rank"),
    ((0, 16, "all-linear", (), None), "model.target_modules is set but model.lora_rank is 0"),
    ((0, 16, None, ("q_proj",), None), "model.exclude_modules is set but model.lora_rank is 0"),
])
def test_bad_lora_settings_fail_with_one_error_naming_the_key(args, match):
    with pytest.raises(ConfigError, match=match):
        check_settings(*args)


def test_a_critics_adapters_and_value_head_export_as_a_peft_token_classification_adapter(tmp_path):
    """PEFT loads a LoRA critic's directory (TOKEN_CLS, the value head in modules_to_save) onto the family's
    ForTokenClassification with no missing or unexpected keys, and computes our values."""
    hf = make_hf_model(tmp_path / "base", critic=True)
    cfg = DecoderConfig.from_hf(tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear"))
    base = load_params(str(tmp_path / "base"), cfg, critic=True)
    adapters = _random_adapters(cfg, spec)
    head = jax.tree.map(lambda x: x + 0.5, base["score"])  # a trained head, unlike the base dir's
    save_peft(adapters, spec, tmp_path / "adapter", cfg, base_model=str(tmp_path / "base"), head=head)

    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    expected = peft.utils.get_peft_model_state_dict(model)
    assert sorted(expected) == sorted(SafetensorsFile(tmp_path / "adapter" / WEIGHTS_NAME).names())
    gd, _ = graphdef_and_abstract_params(spec.apply(cfg), critic=True)
    ours = np.asarray(nnx.merge(gd, combine(base, adapters, {"score": head}))(jnp.asarray(IDS)))  # [B, T]
    with torch.no_grad():
        theirs = model(torch.from_numpy(IDS).long()).logits[..., 0].numpy()
    np.testing.assert_allclose(theirs, ours.reshape(theirs.shape), atol=1e-5, rtol=0)
