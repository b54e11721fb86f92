"""Model families in config.json: each supported one is read as its family, and what we cannot run
(other mixtures of experts, sliding windows, other RoPE types, ...) is one ConfigError naming the field."""

import pytest

from jaxrl_llm.models import PRESETS, ConfigError, DecoderConfig, RopeScaling

# A Mixtral-style MoE key on a dense family (Qwen3-MoE itself is supported: tests/models/test_moe.py).
MIXTRAL_KEYS = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2048,
                    intermediate_size=6144, num_local_experts=8, num_hidden_layers=48, num_attention_heads=32,
                    num_key_value_heads=4, head_dim=128)


def _hub(name, **edits):
    """The preset's config.json with `edits` (None removes a key)."""
    out = PRESETS[name]().to_hf()
    for k, v in edits.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("raw,match", [
    (MIXTRAL_KEYS, r"num_local_experts=8: mixture-of-experts models are not supported for model_type='qwen3'"),
    (_hub("qwen2p5_0p5b", use_sliding_window=True, sliding_window=4096), r"use_sliding_window=true is not supported"),
    (_hub("qwen3_0p6b", layer_types=["full_attention"] * 27 + ["sliding_attention"]),
     r"layer_types has \['sliding_attention'\]; model_type 'qwen3' supports \['full_attention'\] layers"),
    (_hub("llama3p1_8b", rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8192)),
     r"rope_scaling.rope_type='yarn' is not supported; supported rope types: default, llama3"),
    (_hub("qwen3_0p6b", rope_scaling=None, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e6)),
     r"rope_parameters.rope_type='dynamic' is not supported"),
    (_hub("llama3p2_1b", hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (_hub("llama3p2_1b", attention_bias=True), r"attention_bias=true is not supported for model_type 'llama'"),
    (_hub("llama3p2_1b", mlp_bias=True), r"mlp_bias=true is not supported for model_type 'llama'"),
    (_hub("qwen3_8b", attention_bias=True), r"attention_bias=true is not supported for model_type 'qwen3'"),
    (_hub("llama3p1_8b", model_type="mistral", architectures=["MistralForCausalLM"]),
     r"model_type='mistral' \(architectures=\['MistralForCausalLM'\]\) is not supported; jaxrl_llm loads "
     r"model_type 'qwen2' \(Qwen2ForCausalLM, Qwen2ForTokenClassification\); model_type 'qwen3'"),
    (_hub("qwen3_8b", architectures=["Qwen2ForCausalLM"]),
     r"architectures=\['Qwen2ForCausalLM'\] is not supported for model_type 'qwen3'; jaxrl_llm loads "
     r"Qwen3ForCausalLM, Qwen3ForTokenClassification"),
], ids=["moe_keys_on_qwen3", "sliding_window", "sliding_layer_types", "rope_yarn", "rope_parameters_dynamic", "gelu",
        "attention_bias", "mlp_bias", "qwen3_attention_bias", "mistral", "arch_mismatch"])
def test_unsupported_config_is_one_error_naming_the_field(raw, match):
    with pytest.raises(ConfigError, match=r"config dict: " + match):
        DecoderConfig.from_hf(raw)


def test_family_comes_from_model_type_or_architecture():
    assert DecoderConfig.from_hf(_hub("llama3p1_8b", model_type=None)).model_type == "llama"
    assert DecoderConfig.from_hf(_hub("qwen3_4b", model_type=None)).model_type == "qwen3"
    assert DecoderConfig.from_hf(_hub("qwen2p5_7b", model_type=None, architectures=None)).model_type == "qwen2"
    # Qwen3 files may omit head_dim: transformers' default is 128, not hidden / heads.
    assert DecoderConfig.from_hf(_hub("qwen3_0p6b", head_dim=None)).head_dim == 128
    assert DecoderConfig.from_hf(_hub("llama3p1_8b", head_dim=None)).head_dim == 4096 // 32


def test_family_switches():
    q2, q3, ll = PRESETS["qwen2p5_7b"](), PRESETS["qwen3_8b"](), PRESETS["llama3p1_8b"]()
    assert (q2.qkv_bias, q2.qk_norm, q2.rope_scaling) == (True, False, None)
    assert (q3.qkv_bias, q3.qk_norm, q3.rope_scaling) == (False, True, None)
    assert (ll.qkv_bias, ll.qk_norm) == (False, False)
    assert ll.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)
    assert ll.eos_token_ids == (128001, 128008, 128009)
    hash(ll)  # configs are cache keys and static jit arguments


def test_rope_scaling_from_a_gin_style_dict_and_bad_family():
    cfg = PRESETS["tiny"](model_type="llama", rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                 high_freq_factor=4.0))
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, original_max_position_embeddings=512)
    with pytest.raises(ConfigError, match=r"preset 'tiny': model_type='gemma' is not supported"):
        PRESETS["tiny"](model_type="gemma")
    with pytest.raises(ConfigError, match=r"rope_scaling.rope_type='linear' is not supported"):
        PRESETS["tiny"](rope_scaling=dict(rope_type="linear", factor=2.0))
