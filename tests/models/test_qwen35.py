"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Qwen3.5-MoE against transformers 5: logits, export and
reload, parameter counts, the vision-language checkpoint's language model, the value model, packed rows."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_llm.models import DecoderConfig, load_hf, save_hf
from jaxrl_llm.models.hf_io import is_critic_checkpoint
from tests.hf_models import make_qwen35_model, qwen35_config
from tests.models.test_hf_parity import _inputs as hf_inputs
from tests.models.test_hf_parity import _ours, _rel_err, _torch_logits

CASES = {
    # full attention every 2nd layer, untied head
    "dense_every2": dict(family="qwen3_5_text", interval=2, layers=4),
    # every 4th, tied head, equal key and value head counts in the linear layers
    "dense_every4_tied": dict(family="qwen3_5_text", interval=4, layers=4, tie_word_embeddings=True,
                              linear_num_value_heads=2, linear_value_head_dim=8),
    "moe_every2": dict(family="qwen3_5_moe_text", interval=2, layers=4),
    "moe_every4_tied": dict(family="qwen3_5_moe_text", interval=4, layers=8, tie_word_embeddings=True),
}


def _inputs(vocab, b=3, t=40, seed=0):
    """Ids with left padding (as transformers' generate pads)."""
    return hf_inputs(vocab, b=b, t=t, seed=seed)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_then_roundtrip(tmp_path, case):
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "export"
    ref_model = make_qwen35_model(hf_dir, **CASES[case])
    ids, mask, pos = _inputs(ref_model.config.vocab_size)
    ref = _torch_logits(ref_model, ids, mask, pos)

    model = load_hf(hf_dir, dtype="float32")
    assert model.cfg.model_type == CASES[case]["family"] and not is_critic_checkpoint(hf_dir)
    assert model.cfg.num_params() == ref_model.num_parameters()
    ours = _ours(model, ids, mask)
    valid = mask.astype(bool)
    assert _rel_err(ours[valid], ref[valid]) <= 1e-5

    save_hf(model, out_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(reloaded) is type(ref_model)
    again = _torch_logits(reloaded, ids, mask, pos)
    assert _rel_err(again[valid], ref[valid]) <= 1e-5
    assert reloaded.config.layer_types == ref_model.config.layer_types
    assert reloaded.config.tie_word_embeddings == ref_model.config.tie_word_embeddings


def test_packed_rows_equal_the_same_rows_unpacked(tmp_path):
    """Two rows packed into one sequence (segment ids): the linear layers' state and conv window restart at the
    second row, so each row's logits equal its own unpacked forward."""
    make_qwen35_model(tmp_path, family="qwen3_5_moe_text")
    model = load_hf(tmp_path, dtype="float32")
    rng = np.random.default_rng(3)
    a, b = rng.integers(2, 128, size=(1, 23)), rng.integers(2, 128, size=(1, 30))
    packed = np.concatenate([a, b, np.zeros((1, 11), np.int64)], axis=1)
    seg = np.concatenate([np.full(23, 1), np.full(30, 2), np.zeros(11)])[None].astype(np.int32)
    out = np.asarray(jax.jit(lambda i, s: model(i, segment_ids=s))(jnp.asarray(packed), jnp.asarray(seg)))
    alone_a = np.asarray(jax.jit(lambda i: model(i))(jnp.asarray(a)))
    alone_b = np.asarray(jax.jit(lambda i: model(i))(jnp.asarray(b)))
    np.testing.assert_allclose(out[0, :23], alone_a[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[0, 23:53], alone_b[0], rtol=1e-5, atol=1e-5)


def test_vision_language_checkpoint_loads_its_language_model(tmp_path, caplog):
    """A released Qwen3.5 is `Qwen3_5ForConditionalGeneration`: its text_config is read, the language model loads
    from model.language_model.*, the vision tower is skipped with one logged line."""
    text = qwen35_config(tie_word_embeddings=False).to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    vl = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).eval().float()
    vl.save_pretrained(tmp_path)
    ids, mask, pos = _inputs(128)
    ref = _torch_logits(vl, ids, mask, pos)
    with caplog.at_level("INFO"):
        model = load_hf(tmp_path, dtype="float32")
    assert model.cfg.model_type == "qwen3_5_text"
    assert any("vision tower" in r.message for r in caplog.records)
    valid = mask.astype(bool)
    assert _rel_err(_ours(model, ids, mask)[valid], ref[valid]) <= 1e-5


def test_critic_loads_token_classification_then_roundtrip(tmp_path):
    """transformers' Qwen3_5ForTokenClassification (built on the vision-language config) is the value model; its
    export reloads in transformers with the same values (the placeholder vision tower aside)."""
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "export"
    text = qwen35_config().to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(1)
    ref_model = transformers.Qwen3_5ForTokenClassification(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, num_labels=1)).eval().float()
    ref_model.save_pretrained(hf_dir)
    ids, mask, pos = _inputs(128)
    ref = _torch_logits(ref_model, ids, mask, pos)[..., 0]
    assert is_critic_checkpoint(hf_dir)
    critic = load_hf(hf_dir, critic=True)
    valid = mask.astype(bool)
    assert _rel_err(_ours(critic, ids, mask)[valid], ref[valid]) <= 1e-5

    save_hf(critic, out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForTokenClassification"] and cfg["model_type"] == "qwen3_5"
    reloaded = transformers.AutoModelForTokenClassification.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(reloaded) is type(ref_model)
    again = _torch_logits(reloaded, ids, mask, pos)[..., 0]
    assert _rel_err(again[valid], ref[valid]) <= 1e-5
    assert load_hf(out_dir, critic=True).cfg == critic.cfg


def test_presets_have_transformers_shapes():
    """The 9B and 35B-A3B presets count what transformers' default Qwen3.5 text configs count (abstractly: no
    weights are made)."""
    for preset, hf_cls, lm_cls in ((DecoderConfig.qwen3_5_9b, transformers.Qwen3_5TextConfig,
                                    transformers.Qwen3_5ForCausalLM),
                                   (DecoderConfig.qwen3_5_35b_a3b, transformers.Qwen3_5MoeTextConfig,
                                    transformers.Qwen3_5MoeForCausalLM)):
        with torch.device("meta"):
            hf = lm_cls(hf_cls())
        ours = preset()
        assert ours.num_params() == hf.num_parameters()
        assert list(ours.layer_types) == hf.config.layer_types
