"""Full-size presets under jax.eval_shape: shapes and param counts equal HF's."""

import math

import jax
import pytest
from flax import nnx

from jaxrl_llm.models import PRESETS, Qwen2Config, graphdef_and_abstract_params

# Parameter counts as HF's `num_parameters()` reports them for the released checkpoints.
HF_COUNTS = {
    "qwen2p5_0p5b": 494_032_768,
    "qwen2p5_1p5b": 1_543_714_304,
    "qwen2p5_3b": 3_085_938_688,
    "qwen2p5_7b": 7_615_616_512,
    "qwen2p5_14b": 14_770_033_664,
    "qwen2p5_32b": 32_763_876_352,
    "qwen2_7b": 7_615_616_512,
}


@pytest.mark.parametrize("name", sorted(HF_COUNTS))
def test_preset_param_count_under_eval_shape(name):
    cfg = PRESETS[name]()
    _, abstract = graphdef_and_abstract_params(cfg)
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
    assert n == HF_COUNTS[name] == cfg.num_params()


def test_preset_matches_hf_transformers_count():
    """The formula agrees with transformers on a config with every feature (GQA 7, untied)."""
    import transformers

    from tests.hf_models import hf_config

    hf_cfg = hf_config(hidden_size=84, num_attention_heads=7, num_key_value_heads=1, intermediate_size=77)
    hf_n = transformers.Qwen2ForCausalLM(hf_cfg).num_parameters()
    ours = Qwen2Config.from_hf(hf_cfg.to_dict())
    assert ours.num_params() == hf_n
    crit_n = transformers.Qwen2ForTokenClassification(hf_config(num_labels=1)).num_parameters()
    assert Qwen2Config.from_hf(hf_config().to_dict()).num_params(with_value_head=True) == crit_n


def test_7b_forward_under_eval_shape():
    cfg = Qwen2Config.qwen2p5_7b(dtype="bfloat16")
    graphdef, abstract = graphdef_and_abstract_params(cfg)
    ids = jax.ShapeDtypeStruct((2, 64), jax.numpy.int32)
    out = jax.eval_shape(lambda p, i: nnx.merge(graphdef, p)(i), abstract, ids)
    assert out.shape == (2, 64, 152064)


def test_config_errors_name_the_field():
    from jaxrl_llm.models import ConfigError

    with pytest.raises(ConfigError, match=r"preset 'tiny': Qwen2Config has no field\(s\) \['vocab_sise'\] "
                                          r"\(did you mean 'vocab_size' for 'vocab_sise'\?\)"):
        PRESETS["tiny"](vocab_sise=16)
    with pytest.raises(ConfigError, match="config dict: Qwen2Config has no field"):
        Qwen2Config.from_hf(Qwen2Config.tiny().to_hf(), num_layers=2)
    with pytest.raises(ConfigError, match=r"config dict: missing field\(s\) \['intermediate_size'\]"):
        Qwen2Config.from_hf({k: v for k, v in Qwen2Config.tiny().to_hf().items() if k != "intermediate_size"})
    with pytest.raises(ConfigError, match="dtype='float33' is not a floating-point dtype"):
        Qwen2Config.tiny(dtype="float33")
    with pytest.raises(ConfigError, match="param_dtype='int32' is not a floating-point dtype"):
        Qwen2Config.tiny(param_dtype="int32")
    assert Qwen2Config.tiny(dtype="bfloat16", param_dtype="float32").dtype == "bfloat16"
