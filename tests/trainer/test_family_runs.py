"""The other families (Qwen3-MoE included) through the whole trainer: a tiny GRPO run (rollout,
log-prob and update steps, Orbax checkpoint), then `python -m jaxrl_llm.export` and a transformers
reload with the same logits."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl_llm.export import load_checkpoint_params
from jaxrl_llm.models import graphdef_and_abstract_params
from tests.trainer import runs

# The demo's tiny model (gin/grpo_tiny.gin) switched to another family.
FAMILIES = {
    "qwen3": ("{'vocab_size': 16, 'model_type': 'qwen3', 'head_dim': 24, 'tie_word_embeddings': True}",
              "Qwen3ForCausalLM"),
    "llama": ("{'vocab_size': 16, 'model_type': 'llama', 'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0, "
              "'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 4}}",
              "LlamaForCausalLM"),
    # Qwen3-MoE with a dense layer after the sparse one and the router's load-balancing loss on.
    "qwen3_moe": ("{'vocab_size': 16, 'model_type': 'qwen3_moe', 'head_dim': 16, 'num_experts': 4, "
                  "'num_experts_per_tok': 2, 'moe_intermediate_size': 32, 'norm_topk_prob': True, "
                  "'mlp_only_layers': [1], 'output_router_logits': True}", "Qwen3MoeForCausalLM"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_checkpoints_and_exports(family, tmp_path):
    overrides, arch = FAMILIES[family]
    run_dir, out_dir = tmp_path / "run", tmp_path / "hf"
    out = runs.run(run_dir, f"model.overrides={overrides}", steps=2)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = runs.by_step(runs.metrics(run_dir))
    assert rows[1]["actor/grad_norm"] > 0 and all(np.isfinite(r["actor/pg_loss"]) for r in rows.values())
    assert rows[2]["actor/ppo_kl"] != 0  # the step-2 update moved the policy between its two mini-batches
    if family == "qwen3_moe":  # E · Σ f·P: k = 2 for a uniform router, at most E = 4
        assert all(1.0 <= r["actor/router_aux_loss"] <= 4.0 for r in rows.values())

    res = subprocess.run([sys.executable, "-m", "jaxrl_llm.export", "--checkpoint", str(run_dir), "--out",
                          str(out_dir), "--dtype", "float32"], cwd=runs.REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    step, params, cfg, _ = load_checkpoint_params(str(run_dir))
    assert step == 2 and cfg.model_type == family
    hf_cfg = json.loads((out_dir / "config.json").read_text())
    assert hf_cfg["architectures"] == [arch] and hf_cfg["model_type"] == family
    graphdef, _ = graphdef_and_abstract_params(cfg)
    ids = np.array([[2, 12, 7, 13, 14, 5, 3, 8, 9], [3, 12, 4, 13, 14, 9, 1, 1, 1]])  # past the 4-token context
    ours = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(ids)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= 1e-5
