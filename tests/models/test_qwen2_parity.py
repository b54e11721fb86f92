"""Logits parity with transformers' Qwen2 on tiny random configs, then export and reload."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_llm.models import load_hf, save_hf
from tests.hf_models import make_hf_model

CASES = {
    "untied_gqa2": dict(),
    "tied": dict(tie_word_embeddings=True),
    "mha_ratio1": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa_ratio7_odd_hidden": dict(hidden_size=84, num_attention_heads=7, num_key_value_heads=1,
                                  intermediate_size=77),
    "three_layers_theta": dict(num_hidden_layers=3, rope_theta=1_000_000.0, rms_norm_eps=1e-5),
}


def _rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _inputs(vocab, b=3, t=11, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, size=(b, t))
    mask = np.ones((b, t), np.int64)
    mask[1, :4] = 0  # left padding
    mask[2, :7] = 0
    ids[mask == 0] = 0
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return ids, mask, pos


def _torch_logits(model, ids, mask, pos):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(pos))
    return out.logits.float().numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_then_roundtrip(tmp_path, case):
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "export"
    ref_model = make_hf_model(hf_dir, **CASES[case])
    ids, mask, pos = _inputs(ref_model.config.vocab_size)
    ref = _torch_logits(ref_model, ids, mask, pos)

    model = load_hf(hf_dir, dtype="float32")
    ours = np.asarray(jax.jit(lambda i, m: model(i, attention_mask=m))(jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert _rel_err(ours[valid], ref[valid]) <= 1e-5

    save_hf(model, out_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    again = _torch_logits(reloaded, ids, mask, pos)
    assert _rel_err(again[valid], ref[valid]) <= 1e-5
    assert reloaded.config.tie_word_embeddings == ref_model.config.tie_word_embeddings
