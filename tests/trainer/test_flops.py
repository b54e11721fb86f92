"""MFU's FLOPs (`trainer/metrics.py`) for Qwen3.5 against a count by hand: the gated q_proj's double width, the
Gated DeltaNet's projections, conv and chunked delta rule, the quadratic term over the attention layers only, and
the MoE's shared expert; the other families' formula is veRL's, unchanged."""

import numpy as np
import pytest

from jaxrl_llm.models import DecoderConfig
from jaxrl_llm.models.gated_delta import CHUNK
from jaxrl_llm.trainer.metrics import delta_rule_macs, flops_params, veRL_flops

SEQLENS = np.array([10, 30])  # 40 tokens, Σ s² = 1000


def test_qwen35_flops_equal_a_count_by_hand():
    # tiny_qwen35: D 64, V 256, layers 0 and 2 linear, 1 and 3 attention (N 4, K 2, H 16), F 128,
    # linear heads Hk 2, Hv 4 of Dk = Dv = 16, conv width 4.
    cfg = DecoderConfig.tiny_qwen35()
    attention = 64 * 128 + 64 * 32 + 64 * 32 + 64 * 64  # q_proj (query and gate), k, v, o
    # in_proj_qkv (2 Kd + Vd = 128 wide), in_proj_z, in_proj_b and in_proj_a, out_proj, the conv
    linear = 64 * 128 + 64 * 64 + 2 * 64 * 4 + 64 * 64 + 128 * 4
    mlp = 3 * 64 * 128
    embed_and_head = 2 * 256 * 64
    n = 2 * attention + 2 * linear + 4 * mlp + embed_and_head
    assert (attention, linear, n) == (16384, 17408, 198656)
    assert flops_params(cfg) == n
    # the chunked delta rule a token and layer: Hv (3 Dk Dv + C (5 Dk + 3 Dv) / 2)
    macs = 4 * (3 * 16 * 16 + CHUNK * (5 * 16 + 3 * 16) / 2)
    assert CHUNK == 32 and macs == 11264 and delta_rule_macs(cfg) == macs
    quadratic = 12 * 1000 * 16 * 4 * 2  # the two attention layers only
    assert veRL_flops(cfg, SEQLENS) == pytest.approx(6 * n * 40 + quadratic + 6 * 40 * 2 * macs, rel=1e-12)

    # tiny_qwen35_moe: every layer sparse, 8 experts of 32 (top 2), a shared expert of 48 and its [D, 1] gate
    moe = DecoderConfig.tiny_qwen35_moe()
    sparse = 2 * 3 * 64 * 32 + 64 * 8 + 3 * 64 * 48 + 64
    assert flops_params(moe) == 2 * attention + 2 * linear + 4 * sparse + embed_and_head == 188672
    assert veRL_flops(moe, SEQLENS) == pytest.approx(6 * 188672 * 40 + quadratic + 6 * 40 * 2 * macs, rel=1e-12)


def test_the_weights_counted_are_the_models_matmul_weights():
    """On the released shapes (untied: embedding and head are veRL's 2·V·D), N is the active parameter count less
    what a token does not multiply as a weight (the norms, the decay's A_log and dt_bias); a Qwen2 keeps veRL's
    formula."""
    for cfg in (DecoderConfig.qwen3_5_9b(), DecoderConfig.qwen3_5_35b_a3b()):
        d, layers = cfg.hidden_size, cfg.num_hidden_layers
        n_linear = sum(cfg.is_linear_layer(i) for i in range(layers))
        norms = 2 * d * layers + d + 2 * cfg.head_dim * (layers - n_linear)
        linear_extra = n_linear * (2 * cfg.linear_num_value_heads + cfg.linear_value_head_dim)
        assert flops_params(cfg) == cfg.num_params(active=True) - norms - linear_extra
    q = DecoderConfig.qwen2p5_7b()
    d, f, h = q.hidden_size, q.intermediate_size, q.head_dim
    dense = q.num_hidden_layers * (3 * d * f + d * (2 * q.q_dim + 2 * q.kv_dim)) + 2 * q.vocab_size * d
    assert veRL_flops(q, SEQLENS) == pytest.approx(6 * dense * 40 + 12 * 1000 * h * q.num_attention_heads * 28)
