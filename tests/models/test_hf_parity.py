"""Logits parity with transformers on tiny random configs of every family, then export and reload.

Levanter's pattern: a random torch model -> save_pretrained -> load_hf -> compare logits -> save_hf ->
transformers reload -> compare again. Cases cover GQA ratios, odd sizes, an explicit head_dim unlike
hidden / heads, tied and untied heads, and Llama 3's scaled RoPE with a short original context.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_llm.models import load_hf, save_hf
from jaxrl_llm.models.hf_io import is_critic_checkpoint
from tests.hf_models import LLAMA3_ROPE, make_hf_model

CASES = {
    "qwen2_untied_gqa2": dict(family="qwen2"),
    "qwen2_tied": dict(family="qwen2", tie_word_embeddings=True),
    "qwen2_mha_ratio1": dict(family="qwen2", num_attention_heads=4, num_key_value_heads=4),
    "qwen2_gqa_ratio7_odd_hidden": dict(family="qwen2", hidden_size=84, num_attention_heads=7, num_key_value_heads=1,
                                        intermediate_size=77),
    "qwen2_three_layers_theta": dict(family="qwen2", num_hidden_layers=3, rope_theta=1_000_000.0, rms_norm_eps=1e-5),
    # Qwen3: q/k norms, no biases; head_dim 24 makes q [D=64] -> [N H = 96].
    "qwen3_untied_gqa2_head_dim24": dict(family="qwen3", head_dim=24),
    "qwen3_tied_gqa7_odd": dict(family="qwen3", hidden_size=84, num_attention_heads=7, num_key_value_heads=1,
                                intermediate_size=77, head_dim=10, tie_word_embeddings=True),
    "llama_untied_gqa2": dict(family="llama", rms_norm_eps=1e-5),
    "llama3_rope_tied": dict(family="llama", tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE),
    "llama3_rope_untied_gqa3_odd": dict(family="llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                        intermediate_size=77, num_hidden_layers=3, rope_theta=500000.0,
                                        rope_scaling=LLAMA3_ROPE),
}


def _rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _inputs(vocab, b=3, t=48, seed=0):
    """Ids with left padding; the longest row (t = 48) runs past LLAMA3_ROPE's 32-token context."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, size=(b, t))
    mask = np.ones((b, t), np.int64)
    mask[1, :4] = 0  # left padding
    mask[2, :17] = 0
    ids[mask == 0] = 0
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return ids, mask, pos


def _torch_logits(model, ids, mask, pos):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(pos))
    return out.logits.float().numpy()


def _ours(model, ids, mask):
    return np.asarray(jax.jit(lambda i, m: model(i, attention_mask=m))(jnp.asarray(ids), jnp.asarray(mask)))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_then_roundtrip(tmp_path, case):
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "export"
    ref_model = make_hf_model(hf_dir, **CASES[case])
    ids, mask, pos = _inputs(ref_model.config.vocab_size)
    ref = _torch_logits(ref_model, ids, mask, pos)

    model = load_hf(hf_dir, dtype="float32")
    assert model.cfg.model_type == CASES[case]["family"] and not is_critic_checkpoint(hf_dir)
    ours = _ours(model, ids, mask)
    valid = mask.astype(bool)
    assert _rel_err(ours[valid], ref[valid]) <= 1e-5

    save_hf(model, out_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(reloaded) is type(ref_model)
    again = _torch_logits(reloaded, ids, mask, pos)
    assert _rel_err(again[valid], ref[valid]) <= 1e-5
    assert reloaded.config.tie_word_embeddings == ref_model.config.tie_word_embeddings
    assert reloaded.config.rope_parameters == ref_model.config.rope_parameters


def test_llama3_rope_scaling_changes_the_logits(tmp_path):
    """The scaled bands matter on this config: plain RoPE would miss transformers by far more than 1e-5."""
    ref_model = make_hf_model(tmp_path, **CASES["llama3_rope_untied_gqa3_odd"])
    ids, mask, pos = _inputs(ref_model.config.vocab_size)
    ref = _torch_logits(ref_model, ids, mask, pos)
    valid = mask.astype(bool)
    plain = _ours(load_hf(tmp_path, rope_scaling=None), ids, mask)
    assert _rel_err(plain[valid], ref[valid]) > 1e-3


@pytest.mark.parametrize("family,extra", [("qwen2", {}), ("qwen3", dict(head_dim=24)),
                                          ("llama", dict(rope_scaling=LLAMA3_ROPE)),
                                          ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=32, mlp_only_layers=[0]))])
def test_critic_loads_token_classification_then_roundtrip(tmp_path, family, extra):
    """The family's *ForTokenClassification (num_labels 1) is the value model: values equal HF's logits."""
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "export"
    ref_model = make_hf_model(hf_dir, family=family, critic=True, **extra)
    ids, mask, pos = _inputs(ref_model.config.vocab_size)
    ref = _torch_logits(ref_model, ids, mask, pos)[..., 0]  # [B, T]

    assert is_critic_checkpoint(hf_dir)  # how the trainer tells a critic dir from an actor dir
    critic = load_hf(hf_dir, critic=True)
    ours = _ours(critic, ids, mask)
    valid = mask.astype(bool)
    assert _rel_err(ours[valid], ref[valid]) <= 1e-5

    save_hf(critic, out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["architectures"] == [type(ref_model).__name__] and cfg["model_type"] == family
    reloaded = transformers.AutoModelForTokenClassification.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(reloaded) is type(ref_model)
    again = _torch_logits(reloaded, ids, mask, pos)[..., 0]
    assert _rel_err(again[valid], ref[valid]) <= 1e-5
