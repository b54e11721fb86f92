"""Tiny random HF checkpoints of every supported family, built with transformers (the parity reference)."""

from __future__ import annotations

import pathlib

import torch
import transformers

# family -> (config class, causal LM class, token-classification class)
HF_CLASSES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, transformers.Qwen2ForTokenClassification),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, transformers.Qwen3ForTokenClassification),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, transformers.LlamaForTokenClassification),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  transformers.Qwen3MoeForTokenClassification),
}

# Llama 3's RoPE bands on a short original context: with head_dim 16 and theta 1e4 the wavelengths
# are 6.3, 20, 63, 199, ... tokens, so one band is kept (< 32 / 4), one is interpolated (8 .. 32)
# and the rest are divided by `factor` (> 32); sequences longer than 32 tokens go past the context.
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)


def hf_config(family: str = "qwen2", **overrides):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                eos_token_id=1, pad_token_id=0)
    base.update(overrides)
    return HF_CLASSES[family][0](**base)


def make_hf_model(out_dir: pathlib.Path | None = None, *, family: str = "qwen2", seed: int = 0, critic: bool = False,
                  random_biases: bool = True, **overrides):
    """A random causal LM (or ForTokenClassification) of `family`, saved to `out_dir` when given.

    HF initialises biases to zero and norms to one; `random_biases` fills them (q/k/v biases, the
    layer norms, Qwen3's q/k norms, the value head's bias) so that parity covers them too.
    """
    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    _, lm_cls, critic_cls = HF_CLASSES[family]
    if critic:
        cfg.num_labels = 1
    model = (critic_cls if critic else lm_cls)(cfg).eval().float()
    if random_biases:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
    return model


# Qwen3.5 (hybrid linear attention): transformers' text configs, tiny and odd. 2 key and 4 value heads in the linear
# layers (unequal), head dims unlike the attention's, RoPE on a quarter of each head.
QWEN35_CLASSES = {
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
}


def qwen35_config(family: str = "qwen3_5_text", *, interval: int = 2, layers: int = 4, **overrides):
    base = dict(vocab_size=128, hidden_size=48, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                eos_token_id=1, pad_token_id=0,
                layer_types=["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if family == "qwen3_5_moe_text":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    else:
        base.update(intermediate_size=80)
    base.update(overrides)
    return QWEN35_CLASSES[family][0](**base)


def make_qwen35_model(out_dir: pathlib.Path | None = None, *, family: str = "qwen3_5_text", seed: int = 0,
                      interval: int = 2, layers: int = 4, **overrides):
    """A random Qwen3.5 (or Qwen3.5-MoE) causal LM. The norms' offsets, dt_bias and the gated norm's weight are
    drawn too (transformers starts them at 0, 1 and 1), so parity covers them."""
    torch.manual_seed(seed)
    cfg = qwen35_config(family, interval=interval, layers=layers, **overrides)
    model = QWEN35_CLASSES[family][1](cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.1)
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
    return model
