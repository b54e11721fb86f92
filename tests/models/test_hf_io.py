"""HF import/export: sharded index files, and one clear error for each kind of bad model dir."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import CheckpointError, ConfigError, load_hf, save_hf
from jaxrl_llm.models.safetensors_io import SafetensorsFile, save_file
from tests.hf_models import make_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    make_hf_model(d)
    return d


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _rewrite_tensors(d, edit):
    sf = SafetensorsFile(d / "model.safetensors")
    tensors = {n: np.array(sf.get(n)) for n in sf.names()}
    sf.close()
    edit(tensors)
    save_file(tensors.items(), d / "model.safetensors")


def test_sharded_export_with_index_roundtrips(hf_dir, tmp_path):
    model = load_hf(hf_dir)
    out = save_hf(model, tmp_path / "sharded", max_shard_size=20_000, tokenizer_dir=str(hf_dir))
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    again = load_hf(out)
    ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) + 3
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(again(ids)))
    assert (tmp_path / "sharded" / "generation_config.json").exists()


def test_bf16_export_loads_in_bf16(hf_dir, tmp_path):
    model = load_hf(hf_dir)
    save_hf(model, tmp_path / "bf16", dtype="bfloat16")
    again = load_hf(tmp_path / "bf16", dtype="bfloat16")
    assert again.model.norm.weight[...].dtype == jnp.bfloat16
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_missing_tensor_is_named(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path)
    _rewrite_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_hf(d)


def test_extra_tensor_is_named(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path)
    _rewrite_tensors(d, lambda t: t.update({"model.layers.0.self_attn.rel_bias": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.0.self_attn.rel_bias'"):
        load_hf(d)


def test_misshaped_tensor_is_named(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (d / "config.json").write_text(json.dumps(cfg))
    want = r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[96, 64\]"
    with pytest.raises(CheckpointError, match=want):
        load_hf(d)


def test_unsupported_architecture_is_named(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"architectures=\['LlamaForCausalLM'\] is not supported"):
        load_hf(d)


def test_truncated_file_is_named(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .* is truncated or corrupt"):
        load_hf(d)


def test_garbage_file_and_missing_dir(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf(d)
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf(tmp_path / "nowhere")
