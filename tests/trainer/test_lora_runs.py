"""LoRA runs of the tiny demo: only the adapters train (the base stays frozen in the compute dtype and is
the reference), the engine decodes with them, a killed run resumes exactly, the export is a PEFT
directory (or with --merge a full HF one) and `model.lora_adapter_path` starts a run from it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl_llm.export import load_checkpoint_params
from jaxrl_llm.export import main as export_main
from jaxrl_llm.models import graphdef_and_abstract_params, init_params, load_params
from jaxrl_llm.models.lora import combine, is_adapter, partition
from jaxrl_llm.trainer.loop import RLTrainer, build_train_batch
from tests.trainer import runs

LORA = ("model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2", "actor.lr_warmup_steps=0")


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _paths(tree):
    return [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def test_only_the_adapters_train_and_the_base_is_the_frozen_reference(tmp_path):
    run = runs.run_config("train.driver='inprocess'", *LORA, "model.dtype='bfloat16'", "actor.use_kl_loss=True",
                          "algorithm.adv_estimator='gae'",  # PPO: a critic too
                          "train.mesh_fsdp=4", "train.mesh_tensor=2", run_dir=tmp_path / "run")
    trainer = RLTrainer(run)
    w = trainer.worker.obj
    # Adapters shard like the kernels they adapt: lora_a on the kernel's input axis, lora_b on its output one.
    q = w.actor.state["params"]["model"]["layers"]["self_attn"]["q_proj"]
    kernel_spec = w.actor.frozen["model"]["layers"]["self_attn"]["q_proj"]["kernel"].sharding.spec
    assert q["lora_a"].sharding.spec == P(kernel_spec[0], kernel_spec[1], None)
    assert q["lora_b"].sharding.spec == P(kernel_spec[0], None, kernel_spec[2])
    assert kernel_spec[1] == "fsdp" and kernel_spec[2] == "tensor" and len(q["lora_a"].sharding.device_set) == 8
    # The critic takes adapters too; its value head is new and trains in full.
    critic_trained = _paths(w.critic.state["params"])
    assert {p[0] for p in critic_trained if not is_adapter(p)} == {"score"}
    assert any(is_adapter(p) for p in critic_trained) and not any(is_adapter(p) for p in _paths(w.critic.frozen))
    trained, frozen = w.actor.state["params"], w.actor.frozen
    assert _paths(trained) and all(is_adapter(p) for p in _paths(trained))
    assert not any(is_adapter(p) for p in _paths(frozen))
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype("bfloat16")}  # no fp32 master copy
    assert {x.dtype for x in jax.tree.leaves(trained)} == {jnp.dtype("float32")}
    # Optimizer state for the adapters alone: Adam's moments mirror the trained leaves.
    assert sum(x.size for x in jax.tree.leaves(w.actor.state["opt_state"])) < 2.1 * w.actor.num_trained()
    assert w.ref_params is frozen  # the reference is the base without the adapters, not a copy

    prompts = next(trainer.iterator)
    rollout = w.generate([p["prompt_ids"] for p in prompts], trainer.sampling(0))
    batch = build_train_batch(prompts, rollout, run.data.max_response_length)
    # Step 0: lora_b is zero, so the policy is the base.
    np.testing.assert_allclose(w.compute_log_prob(batch)["old_log_prob"], w.compute_ref_log_prob(batch), atol=1e-6)

    frozen_before, trained_before = _host(frozen), _host(trained)
    batch.fields["old_log_prob"] = w.compute_log_prob(batch)["old_log_prob"]
    batch.fields["ref_log_prob"] = w.compute_ref_log_prob(batch)
    batch.fields["advantages"] = np.random.default_rng(0).normal(size=batch.response_mask.shape).astype(np.float32)
    w.update_actor(batch, 0)
    critic_before = _host(w.critic.frozen)
    batch.fields["values"] = w.compute_values(batch)
    batch.fields["returns"] = batch.fields["values"] + batch.fields["advantages"]
    w.update_critic(batch, 0)
    jax.tree.map(np.testing.assert_array_equal, _host(w.critic.frozen), critic_before)
    trained_after = _host(w.actor.state["params"])
    jax.tree.map(np.testing.assert_array_equal, _host(w.actor.frozen), frozen_before)
    lora_b = [a for p, a in zip(_paths(trained_after), jax.tree.leaves(trained_after)) if p[-1] == "lora_b"]
    assert all(np.any(b) for b in lora_b) and not any(np.any(b) for b in jax.tree.leaves(trained_before)[1::2])
    # The engine decodes with the adapters: after the sync its weights are the base with them merged in.
    w.sync_rollout_weights(1)
    merged = _host(w.actor.merged())
    jax.tree.map(np.testing.assert_array_equal, _host(w.engine.params), _host(w.engine._convert(w.actor.merged())))
    q = ("model", "layers", "self_attn", "q_proj", "kernel")
    base_q, merged_q = frozen_before, merged
    for k in q:
        base_q, merged_q = base_q[k], merged_q[k]
    assert np.abs(np.asarray(merged_q, np.float32) - np.asarray(base_q, np.float32)).max() > 0


def test_kill_resume_export_and_start_from_the_adapter(tmp_path):
    steps = 4
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    out = runs.run(ref_dir, *LORA, "train.save_freq=1", steps=steps)
    assert out.returncode == 0, out.stderr[-3000:]
    reference = runs.by_step(runs.metrics(ref_dir))
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
    started = partition(_host(again.worker.obj.actor.state["params"]), is_adapter)[0]
    jax.tree.map(np.testing.assert_array_equal, started, _host(adapters))
