"""The RL loop end to end on tiny models: GRPO and PPO under the Ray driver with the JAX engine, and
GRPO with the vLLM pool (real vLLM on CPU, real Ray), including a pool actor killed mid-run."""

import importlib.util
import os

import numpy as np
import pytest
import ray

from jaxrl_llm.trainer.loop import RLTrainer
from tests.trainer import runs

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    # Eager torch in the vLLM pools' actors (Ray merges these env_vars with each actor's), as in
    # tests/rollout/test_vllm_pool.py: it skips compiling vLLM's logprob-rank helper, cold in each actor.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TORCHDYNAMO_DISABLE": "1"}})
    yield
    ray.shutdown()


def _check_step_metrics(m, *, critic=False):
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                "actor/lr", "critic/score/mean", "critic/advantages/mean", "response_length/mean",
                "response_length/clip_ratio", "prompt_length/mean", "timing_s/gen", "timing_s/update_actor",
                "timing_s/reshard", "timing_s/step", "perf/throughput", "perf/mfu/actor",
                "perf/max_memory_allocated_gb"):
        assert key in m and np.isfinite(m[key]), key
    if critic:
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/returns/mean",
                    "timing_s/log_probs", "timing_s/update_critic"):
            assert key in m and np.isfinite(m[key]), key


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_ray_driver_with_jax_engine(tmp_path, algo):
    params = ["train.driver='ray'", "train.save_freq=1"]
    if algo == "ppo":
        params += ["algorithm.adv_estimator='gae'", "critic.lr=1e-3", "rollout.n=1", "data.train_batch_size=8",
                   "actor.ppo_mini_batch_size=4"]
    else:
        params += ["actor.use_kl_loss=True", "actor.kl_loss_coef=0.01"]
    trainer = RLTrainer(runs.run_config(*params, steps=2, run_dir=tmp_path / algo))
    last = trainer.fit()
    _check_step_metrics(last, critic=algo == "ppo")
    if algo == "grpo":
        assert "actor/kl_loss" in last and "timing_s/log_probs" in last and "timing_s/reward" in last
    assert sorted(os.listdir(tmp_path / algo / "checkpoints")) == ["1", "2"]
    assert [r["step"] for r in runs.metrics(tmp_path / algo)] == [1, 2]


# head_dim 32 (vLLM's CPU attention needs >= 32); fp32 so the trainer-sampler gap is small.
VLLM_MODEL = "model.overrides={'vocab_size': 16, 'num_attention_heads': 2, 'num_key_value_heads': 1}"

@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and os.environ.get("JAXRL_REQUIRE_VLLM") != "1", reason="vllm is not installed")
def test_vllm_engine_loop_survives_a_killed_actor(tmp_path):
    run = runs.run_config("rollout.engine='vllm'", "train.driver='ray'", VLLM_MODEL, steps=3,
                          run_dir=tmp_path / "vllm")
    trainer = RLTrainer(run)
    try:
        m1 = trainer.train_step(next(trainer.iterator), 0)
        trainer.global_step = 1
        _check_step_metrics(m1)
        assert m1["actor/logprob_gap_mean"] < 1e-4 and m1["actor/logprob_gap_max"] < 1e-3
        ray.kill(trainer.engine.pool.actors[0])  # a rollout worker dies between steps
        m2 = trainer.train_step(next(trainer.iterator), 1)
        assert np.isfinite(m2["actor/pg_loss"]) and trainer.engine.pool.version == 2
        val = trainer.validate()
        assert "val-core/arithmetic/reward/mean@1" in val
    finally:
        trainer.engine.pool.shutdown()


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and os.environ.get("JAXRL_REQUIRE_VLLM") != "1", reason="vllm is not installed")
def test_ppo_with_vllm_engine_under_ray(tmp_path):
    """PPO with the pool's weights in a directory of their own (`rollout.weights_dir`, as /dev/shm would
    be): nothing under the run dir, and this run's subdirectory removed at the end."""
    ram = tmp_path / "ram"
    ram.mkdir()
    run = runs.run_config("rollout.engine='vllm'", "train.driver='ray'", VLLM_MODEL, "algorithm.adv_estimator='gae'",
                          "critic.lr=1e-3", "rollout.n=1", f"rollout.weights_dir='{ram}'", steps=1,
                          run_dir=tmp_path / "ppo_vllm")
    trainer = RLTrainer(run)
    assert trainer.engine.weights_dir.startswith(str(ram)) and os.listdir(trainer.engine.weights_dir) == ["0"]
    last = trainer.fit()
    _check_step_metrics(last, critic=True)
    assert last["timing_s/reshard"] > 0
    assert not os.path.exists(tmp_path / "ppo_vllm" / "weights") and os.listdir(ram) == []
