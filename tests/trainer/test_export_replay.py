"""Export a run checkpoint to HF and reload it in transformers; dump batches and replay them exactly."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open

from jaxrl_llm.export import load_checkpoint_params
from jaxrl_llm.models import graphdef_and_abstract_params
from tests.trainer import runs


@pytest.fixture(scope="module")
def dumped_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dumped")
    out = runs.run(d, "train.dump_batches=True", steps=4)
    assert out.returncode == 0, out.stderr[-3000:]
    return d


def _dtypes(path) -> set:
    with safe_open(str(path), "pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _export(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxrl_llm.export", *map(str, args)], cwd=runs.REPO,
                          capture_output=True, text=True)


def test_export_roundtrip_logits_equal_checkpointed_params(dumped_run, tmp_path):
    """The export keeps the run's dtype (the demo's float32) unless --dtype says otherwise, says which it wrote,
    and prints no Orbax warnings about opening the checkpoint read-only."""
    out_dir = tmp_path / "hf"
    res = _export("--checkpoint", dumped_run, "--out", out_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "float32 tensors: the run's model.dtype; --dtype to change" in res.stderr
    assert "WARNING" not in res.stderr and "read only" not in res.stderr, res.stderr
    assert _dtypes(out_dir / "model.safetensors") == {torch.float32}
    assert json.loads((out_dir / "config.json").read_text())["torch_dtype"] == "float32"
    step, params, cfg, _ = load_checkpoint_params(str(dumped_run))
    assert step == 4
    graphdef, _ = graphdef_and_abstract_params(cfg)
    ids = np.array([[2, 12, 7, 13, 14, 5], [3, 12, 4, 13, 14, 9]])
    ours = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(ids)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= 1e-5
    # The run's own (built-in) tokenizer travels with the export. (AutoTokenizer would swap in Qwen2's
    # pre-tokenizer because config.json says qwen2; the demo's word-level vocabulary needs its own.)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(out_dir)
    assert tok.decode(tok("#### 7")["input_ids"]) == "#### 7"
    assert json.loads((out_dir / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_export_to_another_dtype_says_so(dumped_run, tmp_path):
    res = _export("--checkpoint", dumped_run, "--out", tmp_path / "bf16", "--dtype", "bfloat16")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "bfloat16 tensors: the run's model.dtype was float32" in res.stderr
    assert _dtypes(tmp_path / "bf16" / "model.safetensors") == {torch.bfloat16}


def test_export_errors_are_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "jaxrl_llm.export", "--checkpoint", str(tmp_path / "nope"),
                          "--out", str(tmp_path / "o")], cwd=runs.REPO, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip().startswith("error:") and "Traceback" not in res.stderr


def test_replaying_dumped_batches_gives_identical_metrics(dumped_run, tmp_path):
    assert sorted(p.name for p in (dumped_run / "batches").iterdir()) == [f"step_{i:06d}.npz" for i in range(4)]
    replay = tmp_path / "replay"
    out = runs.run(replay, f"train.replay_batches_from='{dumped_run}/batches'", steps=4)
    assert out.returncode == 0, out.stderr[-3000:]
    original, replayed = runs.by_step(runs.metrics(dumped_run)), runs.by_step(runs.metrics(replay))
    # the run crosses an epoch (3 batches an epoch): the replay draws its prompts as the run did, so each step
    # keeps its batch's epoch
    assert [original[step]["training/epoch"] for step in (1, 2, 3, 4)] == [0, 0, 0, 1]
    for step in (1, 2, 3, 4):
        keys = set(replayed[step]) - {"step"}
        assert "actor/pg_loss" in keys and "actor/grad_norm" in keys and "critic/advantages/mean" in keys
        assert {k: replayed[step][k] for k in keys} == {k: original[step][k] for k in keys}, step
