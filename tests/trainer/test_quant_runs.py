"""LoRA runs of the tiny demo on an int8 base (`model.base_quantization='int8'`): the base is held in int8
and is the reference, only the adapters move, the engine decodes the dequantized base with the adapters
merged in, a killed run resumes exactly (the base is re-quantized, not checkpointed), and the merged
export is the int8 base plus the adapters."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.export import load_checkpoint_params
from jaxrl_llm.export import main as export_main
from jaxrl_llm.models import graphdef_and_abstract_params, init_params, load_params, quant
from jaxrl_llm.models.lora import combine
from jaxrl_llm.trainer.loop import RLTrainer, build_train_batch
from tests.trainer import runs

QLORA = ("model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2", "actor.lr_warmup_steps=0",
         "model.base_quantization='int8'")


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def test_an_int8_base_step_moves_only_the_adapters_and_the_engine_decodes_with_them(tmp_path):
    run = runs.run_config("train.driver='inprocess'", *QLORA, "actor.use_kl_loss=True", run_dir=tmp_path / "run")
    trainer = RLTrainer(run)
    w = trainer.worker.obj
    assert w.ref_params is w.actor.frozen
    q = w.actor.frozen["model"]["layers"]["mlp"]["gate_proj"]
    assert q["kernel"].dtype == jnp.int8 and q[quant.SCALE].dtype == jnp.float32

    prompts = next(trainer.iterator)
    rollout = w.generate([p["prompt_ids"] for p in prompts], trainer.sampling(0))
    batch = build_train_batch(prompts, rollout, run.data.max_response_length)
    # Step 0 (lora_b = 0): the policy is the int8 base, which is the reference, and the engine's weights.
    old = w.compute_log_prob(batch)["old_log_prob"]
    np.testing.assert_allclose(old, w.compute_ref_log_prob(batch), atol=1e-6)
    np.testing.assert_allclose(old, batch.fields["rollout_log_probs"] * batch.response_mask, atol=1e-5)

    frozen_before = _host(w.actor.frozen)
    batch.fields["old_log_prob"] = old
    batch.fields["ref_log_prob"] = w.compute_ref_log_prob(batch)
    batch.fields["advantages"] = np.random.default_rng(0).normal(size=batch.response_mask.shape).astype(np.float32)
    w.update_actor(batch, 0)
    jax.tree.map(np.testing.assert_array_equal, _host(w.actor.frozen), frozen_before)

    w.sync_rollout_weights(1)
    # The engine's layer-by-layer merge is the merged tree (to fp32 rounding of where alpha / r is applied).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), _host(w.engine.params),
                 _host(w.engine._convert(w.actor.merged())))
    rollout = w.generate([p["prompt_ids"] for p in prompts], trainer.sampling(1))
    batch = build_train_batch(prompts, rollout, run.data.max_response_length)
    now, base = w.compute_log_prob(batch)["old_log_prob"], w.compute_ref_log_prob(batch)
    np.testing.assert_allclose(now, batch.fields["rollout_log_probs"] * batch.response_mask, atol=1e-5)
    assert np.abs(now - base).max() > 1e-3


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
