"""The 8-bit frozen base (`models/quant.py`): the per-channel error bound of quantize/dequantize, the
int8-base model equals the model run on the dequantized weights bit for bit and stays close to the float
base, the engine's layer-by-layer merge equals the merged tree (a Qwen3.5's linear-attention projections in their
own stack too), and bad settings fail with one error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models import DecoderConfig, graphdef_and_abstract_params, init_params, quant
from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.lora import LoraSpec, combine, init_adapters, merge_adapters, resolve_targets

IDS = np.array([[3, 17, 5, 9, 64, 2, 11, 7], [8, 1, 33, 4, 90, 12, 6, 5]], np.int32)
SPEC = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear"))
PRESETS = {"tiny": DecoderConfig.tiny, "tiny_qwen35": DecoderConfig.tiny_qwen35}


def _spec(cfg):
    return LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear", cfg=cfg))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_dequantize_error_is_bounded_per_output_channel(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 64, 48)) * np.exp(rng.uniform(-3, 1, (3, 1, 48)))  # channels of mixed size
    w[1, :, 5] = 0.0  # an all-zero channel
    q, scale = quant.quantize(jnp.asarray(w, jnp.float32), kind)
    assert q.dtype == quant.QDTYPES[kind] and scale.shape == (3, 48) and scale.dtype == jnp.float32
    back = np.asarray(quant.dequantize(q, scale, jnp.float32), np.float64)
    absmax = np.abs(w).max(axis=-2, keepdims=True)  # [3, 1, 48]
    want_scale = np.where(absmax > 0, absmax / quant.QMAX[kind], 1)
    np.testing.assert_allclose(np.asarray(scale, np.float64)[:, None, :], want_scale, rtol=1e-6)
    err = np.abs(back - w)
    if kind == "int8":  # round to nearest: half a step of the channel's scale
        assert np.all(err <= absmax / 127 * 0.5 * (1 + 1e-5) + 1e-12)
    else:  # e4m3 keeps 3 mantissa bits: within 2^-4 of the value, or half its smallest subnormal step
        assert np.all(err <= np.maximum(np.abs(w) * 2.0 ** -4, absmax / 448 * 2.0 ** -10) * (1 + 1e-5) + 1e-12)
    assert not np.any(back[1, :, 5])
    # Deterministic: quantizing again gives the same bits (what an exact resume rests on).
    q2, s2 = quant.quantize(jnp.asarray(w, jnp.float32), kind)
    np.testing.assert_array_equal(np.asarray(q2.astype(jnp.float32)), np.asarray(q.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(scale))


def _logits(cfg, params):
    gd, _ = graphdef_and_abstract_params(cfg)
    return np.asarray(jax.jit(lambda p: nnx.merge(gd, p)(jnp.asarray(IDS)))(params), np.float64)


@pytest.mark.parametrize("preset,dtype", [("tiny", "float32"), ("tiny", "bfloat16"), ("tiny_qwen35", "float32")])
def test_the_int8_base_runs_its_dequantized_weights_and_stays_close_to_the_float_base(preset, dtype):
    cfg = PRESETS[preset](dtype=dtype, param_dtype="float32")
    spec = _spec(cfg)
    base = jax.tree.map(lambda x: x.astype(dtype), init_params(cfg, seed=0))
    frozen = jax.jit(lambda b: quant.quantize_base(b, "int8"))(base)
    layers = frozen["model"]["layers"]
    assert layers["self_attn"]["q_proj"]["kernel"].dtype == jnp.int8
    assert layers["mlp"]["down_proj"][quant.SCALE].shape == (len(cfg.layer_stacks["layers"]), cfg.hidden_size)
    assert frozen["model"]["embed_tokens"]["embedding"].dtype == jnp.dtype(dtype)  # only the layers' kernels
    if cfg.is_hybrid:  # every projection of the Gated DeltaNet; its conv, decay and norm stay float
        linear = frozen["model"]["linear_layers"]["linear_attn"]
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            assert linear[name]["kernel"].dtype == jnp.int8 and linear[name][quant.SCALE].shape == (
                len(cfg.layer_stacks["linear_layers"]), linear[name]["kernel"].shape[-1])
        assert linear["conv1d"]["kernel"].dtype == jnp.dtype(dtype) and quant.SCALE not in linear["conv1d"]
        n = sum(x.size for x in jax.tree.leaves(frozen) if x.dtype == jnp.int8)
        assert quant.quantized_params(cfg) == n
    fresh = init_adapters(cfg, spec, seed=1)  # lora_b = 0: the adapters change nothing
    qcfg = quant.apply(spec.apply(cfg), "int8")
    got = _logits(qcfg, combine(frozen, fresh))
    # Exactly the model run on the dequantized weights (the same dequantization, then the same matmuls).
    np.testing.assert_array_equal(got, _logits(cfg, quant.dequantize_base(frozen, jnp.dtype(dtype))))
    ref = _logits(cfg, base)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    # Measured 8.5e-3 (fp32) and 9.6e-3 (bf16, where the float base itself rounds) on the tiny random model, 1.6e-2
    # on tiny_qwen35.
    assert rel < 2.5e-2, rel


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_engine_merge_layer_by_layer_equals_the_merged_tree(preset):
    cfg = PRESETS[preset]()
    spec = _spec(cfg)
    frozen = jax.jit(lambda b: quant.quantize_base(b, "int8"))(init_params(cfg, seed=0))
    leaves, tree = jax.tree.flatten(init_adapters(cfg, spec, seed=1))
    adapters = jax.tree.unflatten(tree, [x + 0.1 for x in leaves])
    merged = quant.merged_base(frozen, adapters, spec.scale, jnp.float32)
    # The same as the float merge on the dequantized base.
    ref = merge_adapters(quant.dequantize_base(frozen, jnp.float32), adapters, spec, jnp.float32)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6),
                 merged, ref)
    assert jax.tree.structure(merged) == jax.tree.structure(init_params(cfg, seed=0))  # a plain base
    assert jax.tree.structure(quant.frozen_shardings(cfg, jax.tree.map(lambda _: None, init_params(cfg)), None),
                              is_leaf=lambda x: x is None) == jax.tree.structure(frozen)
    scaled = jax.tree_util.tree_map_with_path(lambda p, x: x * spec.scale if p[-1].key == "lora_b" else x, adapters)
    for stack, ids in cfg.layer_stacks.items():
        layers = combine(frozen, scaled)["model"][stack]
        for j in range(len(ids)):
            layer = quant.plain_layer(jax.tree.map(lambda x, j=j: x[j], layers), jnp.float32)
            want = jax.tree.map(lambda x, j=j: x[j], merged["model"][stack])
            assert jax.tree.structure(layer) == jax.tree.structure(want)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6),
                         layer, want)


def test_bad_settings_fail_with_one_error_naming_the_key():
    quant.check_setting("none", 0)
    quant.check_setting("int8", 8)
    with pytest.raises(ConfigError, match=r"model.base_quantization: 'int4'.*'none'.*'int8' or 'fp8'"):
        quant.check_setting("int4", 8)
    with pytest.raises(ConfigError, match=r"model.base_quantization='int8'.*model.lora_rank > 0"):
        quant.check_setting("int8", 0)
    for moe in (DecoderConfig.tiny_moe(), DecoderConfig.tiny_qwen35_moe()):  # the experts would stay unquantized
        with pytest.raises(ConfigError, match=r"model.base_quantization='fp8'.*mixture-of-experts.*'none'"):
            quant.apply(moe, "fp8")


def test_the_run_config_rejects_a_quantized_base_without_lora():
    from jaxrl_llm.trainer.config import ModelConfig
    from jaxrl_llm.trainer.config.check import ConfigValueError

    ModelConfig(preset="tiny", lora_rank=4, base_quantization="fp8").validate()
    with pytest.raises(ConfigValueError, match=r"model.base_quantization='int8'.*lora_rank"):
        ModelConfig(preset="tiny", lora_rank=0, base_quantization="int8").validate()
    with pytest.raises(ConfigValueError, match=r"model.base_quantization: 'bf16'"):
        ModelConfig(preset="tiny", lora_rank=4, base_quantization="bf16").validate()
