"""LoRA runs of the tiny demo: only the adapters train (the base stays frozen in the compute dtype and is
the reference), the engine decodes with them, a killed run resumes exactly, the export is a PEFT
directory (or with --merge a full HF one) and `model.lora_adapter_path` starts a run from it."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.export import load_checkpoint_params
from jaxrl_llm.export import main as export_main
from jaxrl_llm.models import graphdef_and_abstract_params, init_params, load_params, quant
from jaxrl_llm.models.lora import combine, is_adapter, partition
from jaxrl_llm.trainer.loop import RLTrainer, build_train_batch
from tests.trainer import runs
from tests.trainer.lora_checks import check_the_engine_decodes_with_the_adapters, host

LORA = ("model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2", "actor.lr_warmup_steps=0")


def _paths(tree):
    return [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.mark.parametrize("base", ["none", "int8"])
def test_a_lora_step_moves_only_the_adapters_and_the_engine_decodes_with_them(tmp_path, base):
    """On the compute-dtype base, and on an int8 one (`model.base_quantization`), which is then held in int8
    and is the reference, and which the engine gets dequantized with the adapters merged layer by layer."""
    run = runs.run_config("train.driver='inprocess'", *LORA, "actor.use_kl_loss=True",
                          f"model.base_quantization='{base}'", run_dir=tmp_path / "run")
    trainer = RLTrainer(run)
    w = trainer.worker
    assert w.ref_params is w.actor.frozen  # the reference is the base without the adapters, not a copy
    if base == "int8":
        q = w.actor.frozen["model"]["layers"]["mlp"]["gate_proj"]
        assert q["kernel"].dtype == jnp.int8 and q[quant.SCALE].dtype == jnp.float32

    prompts = next(trainer.iterator)
    rollout = trainer.engine.generate([p["prompt_ids"] for p in prompts], trainer.sampling(0))
    batch = build_train_batch(prompts, rollout, run.data.max_response_length)
    # Step 0: lora_b is zero, so the policy is the base (and the sampler's log-probs are the trainer's).
    old = w.compute_log_prob(batch)["old_log_prob"]
    np.testing.assert_allclose(old, w.compute_ref_log_prob(batch), atol=1e-6)
    np.testing.assert_allclose(old, batch.fields["rollout_log_probs"] * batch.response_mask, atol=1e-5)

    frozen_before = host(w.actor.frozen)
    batch.fields["old_log_prob"] = old
    batch.fields["ref_log_prob"] = w.compute_ref_log_prob(batch)
    batch.fields["advantages"] = np.random.default_rng(0).normal(size=batch.response_mask.shape).astype(np.float32)
    w.update_actor(batch, 0)
    jax.tree.map(np.testing.assert_array_equal, host(w.actor.frozen), frozen_before)
    trained = host(w.actor.state["params"])
    assert all(np.any(b) for p, b in zip(_paths(trained), jax.tree.leaves(trained)) if p[-1] == "lora_b")

    # The engine decodes with the adapters: after the sync its weights are the base with them merged in
    # (int8: to fp32 rounding of where alpha / r is applied), and its log-probs of what it samples are the
    # trainer's under the adapters.
    check_the_engine_decodes_with_the_adapters(w, trainer, run, prompts, atol=0.0 if base == "none" else 1e-6)


STEPS = 4


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """An uninterrupted LoRA run of the demo: its directory and its metrics by step (the resume test's reference;
    the offline PEFT test exports it)."""
    d = tmp_path_factory.mktemp("lora_run")
    out = runs.run(d, *LORA, "train.save_freq=1", steps=STEPS)
    assert out.returncode == 0, out.stderr[-3000:]
    return d, runs.by_step(runs.metrics(d))


def test_kill_resume_export_and_start_from_the_adapter(tmp_path, lora_run):
    steps = STEPS
    run_dir, reference = tmp_path / "run", lora_run[1]
    resumed = runs.kill_then_resume(run_dir, *LORA, "train.save_freq=1", steps=steps, kill_after=[2])
    assert resumed == reference

    # The checkpoint holds the adapters (and their optimizer state) only.
    step, adapters, cfg, _ = load_checkpoint_params(str(run_dir))
    assert step == steps and all(is_adapter(p) for p in _paths(adapters))

    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    assert export_main(["--checkpoint", str(run_dir), "--out", str(peft_dir), "--dtype", "float32"]) == 0
    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["lora_alpha"] == 8 and len(conf["target_modules"]) == 7
    assert export_main(["--checkpoint", str(run_dir), "--out", str(merged_dir), "--dtype", "float32",
                        "--merge"]) == 0
    # The merged export computes what the base (re-drawn from the preset's seed) with the adapters does.
    base = init_params(cfg, seed=0)
    ids = jnp.asarray(np.array([[2, 5, 3, 7, 9, 4]], np.int32))
    lora_gd, _ = graphdef_and_abstract_params(cfg.replace(lora_rank=4, lora_alpha=8.0,
                                                          lora_targets=tuple(conf["target_modules"])))
    base_gd, _ = graphdef_and_abstract_params(cfg)
    ours = nnx.merge(lora_gd, combine(base, adapters))(ids)
    exported = nnx.merge(base_gd, load_params(str(merged_dir), cfg))(ids)
    np.testing.assert_allclose(np.asarray(exported), np.asarray(ours), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(ours) - np.asarray(nnx.merge(base_gd, base)(ids))).max() > 1e-3

    # A new run from the exported adapter starts with exactly those adapters.
    again = RLTrainer(runs.run_config("train.driver='inprocess'", *LORA, f"model.lora_adapter_path='{peft_dir}'",
                                      run_dir=tmp_path / "again"))
    started = partition(host(again.worker.actor.state["params"]), is_adapter)[0]
    jax.tree.map(np.testing.assert_array_equal, started, host(adapters))


def test_a_lora_critic_exports_as_a_peft_adapter_with_its_head_or_merged(tmp_path):
    """PPO with LoRA: `--critic` writes the critic's adapters and value head as a PEFT TOKEN_CLS directory, and
    with `--merge` a full ForTokenClassification directory computing the critic's values."""
    run_dir = tmp_path / "ppo"
    trainer = RLTrainer(runs.run_config("train.driver='inprocess'", *LORA, "algorithm.adv_estimator='gae'",
                                        "critic.lr=1e-3", "rollout.n=1", run_dir=run_dir))
    try:
        trainer.save_checkpoint()
        trainer.worker.wait_checkpoint()
    finally:
        trainer.worker.close_checkpointer()
    critic = trainer.worker.critic
    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    assert export_main(["--checkpoint", str(run_dir), "--out", str(peft_dir), "--critic", "--dtype", "float32"]) == 0
    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    assert conf["task_type"] == "TOKEN_CLS" and conf["modules_to_save"] == ["score"] and conf["r"] == 4
    assert export_main(["--checkpoint", str(run_dir), "--out", str(merged_dir), "--critic", "--merge",
                        "--dtype", "float32"]) == 0
    cfg = critic.cfg
    ids = jnp.asarray(np.array([[2, 5, 3, 7, 9, 4]], np.int32))
    base_gd, _ = graphdef_and_abstract_params(cfg, critic=True)
    exported = nnx.merge(base_gd, load_params(str(merged_dir), cfg, critic=True))(ids)
    ours = nnx.merge(critic.graphdef, critic.params())(ids)
    np.testing.assert_allclose(np.asarray(exported), np.asarray(ours), atol=1e-5, rtol=0)


def test_the_peft_export_of_a_preset_run_loads_offline_with_auto_peft(tmp_path, lora_run):
    """A run on a random preset has no base on disk or on the hub: the export writes it beside the adapter
    (`base/`, named by its absolute path), so AutoPeftModelForCausalLM loads the pair offline, from any working
    directory, and computes the run's logits."""
    run_dir, peft_dir = lora_run[0], tmp_path / "peft"
    assert export_main(["--checkpoint", str(run_dir), "--out", str(peft_dir)]) == 0
    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(peft_dir / "base")
    assert (peft_dir / "base" / "config.json").exists() and (peft_dir / "tokenizer.json").exists()

    ids = [[2, 5, 3, 7, 9, 4], [3, 12, 4, 13, 14, 9]]
    script = ("import json, sys, torch\n"
              "from peft import AutoPeftModelForCausalLM\n"
              "m = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
              "with torch.no_grad():\n"
              f"    print(json.dumps(m(torch.tensor({ids})).logits.tolist()))\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = subprocess.run([sys.executable, "-c", script, str(peft_dir)], cwd=elsewhere, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                            "TRANSFORMERS_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = np.array(json.loads(res.stdout.strip().splitlines()[-1]))

    step, adapters, cfg, _ = load_checkpoint_params(str(run_dir))
    lora_gd, _ = graphdef_and_abstract_params(cfg.replace(lora_rank=4, lora_alpha=8.0,
                                                          lora_targets=tuple(conf["target_modules"])))
    ours = np.asarray(nnx.merge(lora_gd, combine(init_params(cfg, seed=0), adapters))(jnp.asarray(ids)))
    assert np.max(np.abs(theirs - ours)) / np.max(np.abs(ours)) <= 1e-5
