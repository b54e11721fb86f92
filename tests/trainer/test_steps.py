"""One RL step in process: lr 0 is an exact no-op, a NaN gradient is skipped, nothing recompiles in
the steady state, a failing reward function is counted, and a full disk at checkpoint time leaves the
last good checkpoint intact."""

import os
import textwrap

import jax
import numpy as np
import pytest

from jaxrl_llm import distributed
from jaxrl_llm.checkpoint import CheckpointSaveError, RunCheckpointer
from jaxrl_llm.trainer.loop import RLTrainer
from tests.trainer import runs


def _trainer(tmp_path, *params, steps=4):
    return RLTrainer(runs.run_config("train.driver='inprocess'", *params, steps=steps, run_dir=tmp_path / "run"))


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_lr_zero_step_leaves_params_bit_identical(tmp_path):
    # One mini-batch a step: exactly on-policy, so the old log-probs are the current ones.
    trainer = _trainer(tmp_path, "actor.lr=0.0", "actor.lr_warmup_steps=0", "actor.ppo_mini_batch_size=8")
    assert not trainer.worker.needs_old_log_prob()
    w = trainer.worker
    before = _host(w.actor_state["params"])
    m = trainer.train_step(next(trainer.iterator), 0)
    assert _same(before, _host(w.actor_state["params"]))
    assert m["actor/lr"] == 0.0 and m["actor/grad_norm"] > 0  # a real gradient, applied with lr 0
    assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0 and m["actor/pg_clipfrac_lower"] == 0.0
    assert "timing_s/log_probs" not in m and "actor/entropy_rollout" not in m
    # Sampler vs trainer log-probs of the sampled tokens: the same fp32 weights, differently fused.
    assert m["actor/logprob_gap_mean"] < 1e-6 and m["actor/logprob_gap_max"] < 1e-5


def test_nan_gradient_skips_the_update(tmp_path):
    trainer = _trainer(tmp_path)
    w = trainer.worker
    prompts = next(trainer.iterator)
    rollout = trainer.engine.generate([p["prompt_ids"] for p in prompts], trainer.sampling(0))
    from jaxrl_llm.trainer.loop import build_train_batch

    batch = build_train_batch(prompts, rollout, trainer.run.data.max_response_length)
    batch.fields["old_log_prob"] = w.compute_log_prob(batch)["old_log_prob"]
    batch.fields["advantages"] = np.ones_like(batch.response_mask)
    batch.fields["advantages"][0, 0] = np.nan  # one poisoned token in the first mini-batch
    state_before = _host(w.actor_state)
    m = w.update_actor(batch, 0)
    assert trainer.engine.sampler.params is None  # rollout.free_cache_engine: the engine's copy is dropped for updates
    assert m["actor/skipped_steps"] == 1.0  # of the 2 mini-batch updates, the poisoned one
    after = _host(w.actor_state)
    assert int(after["skipped"]) == 1 and int(after["step"]) == int(state_before["step"]) + 1
    batch.fields["advantages"][0, 0] = np.inf
    before = _host(w.actor_state)
    only_bad = batch.select(np.arange(4))  # exactly one mini-batch, the poisoned one
    w.update_actor(only_bad, 1)
    after = _host(w.actor_state)
    assert _same(before["params"], after["params"]) and _same(before["opt_state"], after["opt_state"])
    trainer.engine.sync(2)  # and the sync rebuilds it
    assert trainer.engine.generate([prompts[0]["prompt_ids"]], trainer.sampling(1)).weight_version == 2


def test_no_recompiles_in_the_steady_state(tmp_path):
    trainer = _trainer(tmp_path, "train.save_freq=1", steps=6)
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    for step in range(2):  # warm-up: every program is compiled here
        trainer.train_step(next(trainer.iterator), step)
        trainer.global_step = step + 1
        trainer.save_checkpoint()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for step in range(2, 5):
            trainer.train_step(next(trainer.iterator), step)
            trainer.global_step = step + 1
            trainer.save_checkpoint()
        trainer.worker.wait_checkpoint()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [], f"{len(compiles)} compilations in steps 2-4"


def test_failing_reward_function_is_counted_and_the_run_goes_on(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str.endswith("1"):
                raise RuntimeError("boom")
            if solution_str.endswith("2"):
                return float("nan")
            return 1.0 if solution_str.strip() == "#### " + ground_truth else 0.0
    """))
    trainer = _trainer(tmp_path, f"reward.custom_reward_path='{path}'")
    m = trainer.train_step(next(trainer.iterator), 0)
    assert m["reward/num_errors"] > 0 and m["reward/num_nonfinite"] > 0
    assert np.isfinite(m["actor/pg_loss"]) and np.isfinite(m["critic/score/mean"])


@pytest.mark.parametrize("fault", ["disk_full", "unwritable"])
def test_checkpoint_failure_is_clear_and_keeps_the_last_good_one(tmp_path, monkeypatch, fault):
    trainer = _trainer(tmp_path, "train.save_freq=1", steps=3)
    ckpt = trainer.worker.ckpt
    trainer.train_step(next(trainer.iterator), 0)
    trainer.global_step = 1
    trainer.save_checkpoint()
    trainer.worker.wait_checkpoint()
    if fault == "disk_full":
        def full(*a, **k):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(ckpt.manager, "save", full)
    else:
        monkeypatch.setattr(ckpt.manager, "save", lambda *a, **k: os.mkdir("/proc/jaxrl-cannot-write-here"))
    trainer.train_step(next(trainer.iterator), 1)
    trainer.global_step = 2
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint step 2 .* failed .* earlier checkpoints \[1\]"):
        trainer.save_checkpoint()
    monkeypatch.undo()
    again = RunCheckpointer(str(tmp_path / "run" / "checkpoints"), read_only=True)
    assert again.steps() == [1]
    step, actor, _, meta = again.restore_latest_valid(actor=trainer.worker.actor_state)
    assert step == 1 and meta["step"] == 1 and meta["data"]["position"] == 1


def test_reference_offloaded_to_host_gives_the_same_kl_loss(tmp_path):
    kl = ("actor.use_kl_loss=True", "actor.kl_loss_coef=0.01")
    a = _trainer(tmp_path / "a", *kl)
    b = _trainer(tmp_path / "b", *kl, "train.ref_offload=True")
    # The frozen copy lives on the host: every leaf is this process's shards as numpy arrays.
    leaves = jax.tree.leaves(b.worker.ref_params)
    assert leaves and all(isinstance(x, distributed.HostShards) for x in leaves)
    assert all(isinstance(data, np.ndarray) for x in leaves for _, data in x.shards)
    ma, mb = a.train_step(next(a.iterator), 0), b.train_step(next(b.iterator), 0)
    for key in ("actor/kl_loss", "actor/pg_loss", "actor/grad_norm"):
        assert ma[key] == mb[key], key


def test_a_run_resumed_at_an_epoch_boundary_trains_the_configured_steps(tmp_path, monkeypatch):
    """25 prompts, 8 a batch: 3 steps an epoch, train.total_epochs 2 (6 steps). The run dies in step 4, once the
    checkpoint of step 3 (the boundary: the iterator at epoch 1, position 0) has committed; the resumed run trains
    steps 4 to 6 (veRL trains none there), each logged once with its batch's epoch (step 3 is epoch 0's last)."""
    params = ("train.driver='inprocess'", "train.total_training_steps=None", "train.total_epochs=2",
              "train.save_freq=3")
    run_dir = tmp_path / "run"
    step = RLTrainer.step

    def dies_in_step_4(self, k):
        if k == 3:
            self.worker.wait_checkpoint()  # checkpoint 3 committed, as before a SIGKILL in step 4
            raise RuntimeError("killed in step 4")
        return step(self, k)

    monkeypatch.setattr(RLTrainer, "step", dies_in_step_4)
    with pytest.raises(RuntimeError, match="killed in step 4"):
        RLTrainer(runs.run_config(*params, run_dir=run_dir)).fit()
    monkeypatch.setattr(RLTrainer, "step", step)
    resumed = RLTrainer(runs.run_config(*params, run_dir=run_dir))
    state = resumed.iterator.state_dict()
    assert resumed.global_step == resumed.iterator.steps_per_epoch == 3
    assert (state["epoch"], state["position"]) == (1, 0)
    resumed.fit()
    assert resumed.global_step == resumed.total_steps == 6
    rows = runs.metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["training/epoch"] for r in rows] == [0, 0, 0, 1, 1, 1]
