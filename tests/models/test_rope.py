"""RoPE frequencies: Llama 3's scaled bands against a float64 numpy reference and transformers' own."""

import math

import numpy as np
import pytest
import torch
import transformers

from jaxrl_llm.models import ConfigError, RopeScaling
from jaxrl_llm.models.rope import rope_inv_freq, rope_scaling_from_hf
from tests.hf_models import LLAMA3_ROPE, hf_config


def _llama3_reference(head_dim, theta, factor, low, high, old_context):
    """Llama 3.1's reference formula (meta-llama `apply_scaling`), in float64, one frequency at a time."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            out.append(freq)
        elif wavelen > old_context / low:
            out.append(freq / factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("head_dim,theta,scaling", [
    (16, 10000.0, RopeScaling(8.0, 1.0, 4.0, 32)),  # the tests' tiny config
    (128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192)),  # Llama 3.1 8B
    (64, 500000.0, RopeScaling(32.0, 1.0, 4.0, 8192)),  # Llama 3.2 1B
])
def test_llama3_frequencies_match_float64_reference_and_cover_every_band(head_dim, theta, scaling):
    ours = np.asarray(rope_inv_freq(head_dim, theta, scaling), np.float64)
    ref = _llama3_reference(head_dim, theta, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                            scaling.original_max_position_embeddings)
    np.testing.assert_allclose(ours, ref, rtol=3e-6, atol=0)
    plain = np.asarray(rope_inv_freq(head_dim, theta, None), np.float64)
    kept, divided = np.isclose(ours, plain, rtol=1e-6), np.isclose(ours, plain / scaling.factor, rtol=1e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three bands occur


def test_frequencies_equal_transformers_llama3_init():
    cfg = hf_config("llama", rope_scaling=LLAMA3_ROPE)
    ref, scale = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    ours = np.asarray(rope_inv_freq(16, 10000.0, rope_scaling_from_hf(LLAMA3_ROPE, where="test")))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=0)
    assert scale == 1.0  # llama3 scales no attention logits


@pytest.mark.parametrize("rope,match", [
    (dict(rope_type="yarn", factor=4.0), r"rope_scaling.rope_type='yarn' is not supported"),
    (dict(type="dynamic", factor=2.0), r"rope_scaling.rope_type='dynamic' is not supported"),
    (dict(rope_type="default", partial_rotary_factor=0.5), r"rope_scaling.partial_rotary_factor=0.5"),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0), r"lacks \['high_freq_factor'\]"),
    (dict(LLAMA3_ROPE, low_freq_factor=4.0), r"need 0 < low_freq_factor \(4.0\) < high_freq_factor \(4.0\)"),
])
def test_unsupported_rope_is_one_error_naming_the_field(rope, match):
    with pytest.raises(ConfigError, match=match):
        rope_scaling_from_hf(rope, where="config.json")
