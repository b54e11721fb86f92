"""A LoRA run of the tiny demo on an int8 base (`model.base_quantization='int8'`): a killed run resumes
exactly (the base is re-quantized, not checkpointed), and the merged export is the int8 base plus the
adapters. (One int8 step, its frozen base and the engine's merge: tests/trainer/test_lora_runs.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.export import load_checkpoint_params
from jaxrl_llm.export import main as export_main
from jaxrl_llm.models import graphdef_and_abstract_params, init_params, load_params, quant
from jaxrl_llm.models.lora import combine
from tests.trainer import runs

QLORA = ("model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2", "actor.lr_warmup_steps=0",
         "model.base_quantization='int8'")


def test_an_int8_base_run_resumes_exactly_and_exports_merged(tmp_path):
    steps = 4
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    out = runs.run(ref_dir, *QLORA, "train.save_freq=1", steps=steps)
    assert out.returncode == 0, out.stderr[-3000:]
    reference = runs.by_step(runs.metrics(ref_dir))
    resumed = runs.kill_then_resume(run_dir, *QLORA, "train.save_freq=1", steps=steps, kill_after=[2])
    assert resumed == reference

    merged_dir = tmp_path / "merged"
    assert export_main(["--checkpoint", str(run_dir), "--out", str(merged_dir), "--dtype", "float32",
                        "--merge"]) == 0
    step, adapters, cfg, _ = load_checkpoint_params(str(run_dir))
    # The merged export computes the int8 base (the preset re-drawn in the demo's fp32 and quantized) with the adapters.
    frozen = quant.quantize_base(jax.tree.map(lambda x: x.astype(jnp.float32), init_params(cfg, seed=0)),
                                 "int8")
    qcfg = quant.apply(cfg.replace(lora_rank=4, lora_alpha=8.0, lora_targets=tuple(quant.QUANT_MODULES)), "int8")
    ids = jnp.asarray(np.array([[2, 5, 3, 7, 9, 4]], np.int32))
    qgd, _ = graphdef_and_abstract_params(qcfg.replace(dtype="float32"))
    ours = nnx.merge(qgd, combine(frozen, adapters))(ids)
    base_gd, _ = graphdef_and_abstract_params(cfg.replace(dtype="float32"))
    exported = nnx.merge(base_gd, load_params(str(merged_dir), cfg))(ids)
    np.testing.assert_allclose(np.asarray(exported), np.asarray(ours), atol=1e-4, rtol=0)
