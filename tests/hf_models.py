"""Tiny random HF Qwen2 checkpoints built with transformers (the parity reference)."""

from __future__ import annotations

import pathlib

import torch
import transformers


def hf_config(**overrides) -> transformers.Qwen2Config:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                eos_token_id=1, pad_token_id=0)
    base.update(overrides)
    return transformers.Qwen2Config(**base)


def make_hf_model(out_dir: pathlib.Path | None = None, *, seed: int = 0, critic: bool = False,
                  random_biases: bool = True, **overrides):
    """A random Qwen2ForCausalLM (or ForTokenClassification), saved to `out_dir` when given.

    HF initialises biases to zero; `random_biases` fills them so that parity covers them too.
    """
    torch.manual_seed(seed)
    cfg = hf_config(**overrides)
    cls = transformers.Qwen2ForTokenClassification if critic else transformers.Qwen2ForCausalLM
    if critic:
        cfg.num_labels = 1
    model = cls(cfg).eval().float()
    if random_biases:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
    return model
