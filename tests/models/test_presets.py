"""Full-size presets under jax.eval_shape: shapes and param counts equal HF's."""

import math

import jax
import pytest
import torch
import transformers
from flax import nnx

from jaxrl_llm.models import PRESETS, DecoderConfig, Qwen2Config, graphdef_and_abstract_params

# Parameter counts as HF's `num_parameters()` reports them for the released checkpoints.
HF_COUNTS = {
    "qwen2p5_0p5b": 494_032_768,
    "qwen2p5_1p5b": 1_543_714_304,
    "qwen2p5_3b": 3_085_938_688,
    "qwen2p5_7b": 7_615_616_512,
    "qwen2p5_14b": 14_770_033_664,
    "qwen2p5_32b": 32_763_876_352,
    "qwen2_7b": 7_615_616_512,
    "qwen3_0p6b": 596_049_920,
    "qwen3_1p7b": 1_720_574_976,
    "qwen3_4b": 4_022_468_096,
    "qwen3_8b": 8_190_735_360,
    "llama3p2_1b": 1_235_814_400,
    "llama3p2_3b": 3_212_749_824,
    "llama3p1_8b": 8_030_261_248,
    "qwen3_30b_a3b": 30_532_122_624,
    "qwen3_235b_a22b": 235_093_634_560,
}

# The config.json of each released checkpoint (Qwen/Qwen3-*, meta-llama/Llama-3.x-*-Instruct), as on the hub.
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, attention_dropout=0.0,
              bos_token_id=151643, eos_token_id=151645, head_dim=128, hidden_act="silu", initializer_range=0.02,
              max_position_embeddings=40960, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000,
              sliding_window=None, use_sliding_window=False, torch_dtype="bfloat16", use_cache=True,
              vocab_size=151936)
_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, attention_dropout=0.0,
               bos_token_id=128000, eos_token_id=[128001, 128008, 128009], hidden_act="silu", initializer_range=0.02,
               max_position_embeddings=131072, mlp_bias=False, pretraining_tp=1, rms_norm_eps=1e-05,
               rope_theta=500000.0, torch_dtype="bfloat16", use_cache=True, vocab_size=128256)
_LLAMA3_ROPE = dict(high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192,
                    rope_type="llama3")
# Qwen/Qwen3-30B-A3B: Qwen3 with 128 experts, top-8, every layer sparse. (Qwen3-235B-A22B's count above is
# transformers' on the meta device; building that model takes half a minute, so it is not rebuilt here.)
_QWEN3_MOE = dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=True, num_experts=128, num_experts_per_tok=8,
                  output_router_logits=False, router_aux_loss_coef=0.001, tie_word_embeddings=False)
HUB_CONFIGS = {
    "qwen3_30b_a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          max_window_layers=48, num_attention_heads=32, num_hidden_layers=48, num_key_value_heads=4),
    "qwen3_0p6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, max_window_layers=28, num_attention_heads=16,
                       num_hidden_layers=28, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_1p7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, max_window_layers=28, num_attention_heads=16,
                       num_hidden_layers=28, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, max_window_layers=36, num_attention_heads=32,
                     num_hidden_layers=36, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, max_window_layers=36, num_attention_heads=32,
                     num_hidden_layers=36, num_key_value_heads=8, tie_word_embeddings=False),
    "llama3p2_1b": dict(_LLAMA3, head_dim=64, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                        num_hidden_layers=16, num_key_value_heads=8, tie_word_embeddings=True,
                        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama3p2_3b": dict(_LLAMA3, head_dim=128, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                        num_hidden_layers=28, num_key_value_heads=8, tie_word_embeddings=True,
                        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama3p1_8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                        num_hidden_layers=32, num_key_value_heads=8, tie_word_embeddings=False,
                        rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
}


@pytest.mark.parametrize("name", sorted(HF_COUNTS))
def test_preset_param_count_under_eval_shape(name):
    cfg = PRESETS[name]()
    _, abstract = graphdef_and_abstract_params(cfg)
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
    assert n == HF_COUNTS[name] == cfg.num_params()


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_preset_equals_hub_config_and_transformers_count(name):
    """The preset is the hub config.json, and transformers' model of it (on the meta device: no
    memory) has the parameters our eval_shape tree has."""
    hub = HUB_CONFIGS[name]
    assert DecoderConfig.from_hf(hub) == PRESETS[name]()
    hf_cfg = transformers.AutoConfig.for_model(**hub)
    with torch.device("meta"):
        hf_n = transformers.AutoModelForCausalLM.from_config(hf_cfg).num_parameters()
    assert hf_n == HF_COUNTS[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_roundtrips_through_hf_config(name):
    cfg = PRESETS[name]()
    assert DecoderConfig.from_hf(cfg.to_hf()) == cfg
    critic = DecoderConfig.from_hf(cfg.to_hf(critic=True))
    assert critic == cfg and cfg.to_hf(critic=True)["architectures"] == [cfg.family.critic]


@pytest.mark.parametrize("family,extra", [("qwen2", {}), ("qwen3", dict(head_dim=12)), ("llama", {})])
def test_num_params_formula_matches_transformers(family, extra):
    """The formula agrees with transformers on a config with every feature (GQA 7, untied) and on the critic."""
    from tests.hf_models import HF_CLASSES, hf_config

    _, lm_cls, critic_cls = HF_CLASSES[family]
    hf_cfg = hf_config(family, hidden_size=84, num_attention_heads=7, num_key_value_heads=1, intermediate_size=77,
                       **extra)
    ours = DecoderConfig.from_hf(hf_cfg.to_dict())
    assert ours.model_type == family and ours.num_params() == lm_cls(hf_cfg).num_parameters()
    crit_n = critic_cls(hf_config(family, num_labels=1, **extra)).num_parameters()
    assert DecoderConfig.from_hf(hf_config(family, **extra).to_dict()).num_params(with_value_head=True) == crit_n


def test_7b_forward_under_eval_shape():
    cfg = Qwen2Config.qwen2p5_7b(dtype="bfloat16")
    graphdef, abstract = graphdef_and_abstract_params(cfg)
    ids = jax.ShapeDtypeStruct((2, 64), jax.numpy.int32)
    out = jax.eval_shape(lambda p, i: nnx.merge(graphdef, p)(i), abstract, ids)
    assert out.shape == (2, 64, 152064)


def test_config_errors_name_the_field():
    from jaxrl_llm.models import ConfigError

    with pytest.raises(ConfigError, match=r"preset 'tiny': DecoderConfig has no field\(s\) \['vocab_sise'\] "
                                          r"\(did you mean 'vocab_size' for 'vocab_sise'\?\)"):
        PRESETS["tiny"](vocab_sise=16)
    with pytest.raises(ConfigError, match="config dict: DecoderConfig has no field"):
        Qwen2Config.from_hf(Qwen2Config.tiny().to_hf(), num_layers=2)
    with pytest.raises(ConfigError, match=r"config dict: missing field\(s\) \['intermediate_size'\]"):
        Qwen2Config.from_hf({k: v for k, v in Qwen2Config.tiny().to_hf().items() if k != "intermediate_size"})
    with pytest.raises(ConfigError, match="dtype='float33' is not a floating-point dtype"):
        Qwen2Config.tiny(dtype="float33")
    with pytest.raises(ConfigError, match="param_dtype='int32' is not a floating-point dtype"):
        Qwen2Config.tiny(param_dtype="int32")
    assert Qwen2Config.tiny(dtype="bfloat16", param_dtype="float32").dtype == "bfloat16"
