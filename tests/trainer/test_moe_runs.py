"""GRPO on the tiny Qwen3-MoE end to end with every engine: the paged JAX sampler with routing replay R3,
the dense one with R2, and the vLLM pool (real vLLM on CPU, real Ray), whose in-place weight updates of
a MoE then generate what the JAX engine does. Routing replay's clear errors."""

import importlib.util
import os

import jax
import numpy as np
import pytest

from jaxrl_llm.models import init_params
from jaxrl_llm.rollout import JaxEngine, RolloutError, SamplingParams
from jaxrl_llm.train import UsageError
from jaxrl_llm.trainer.batch import TrainBatch
from jaxrl_llm.trainer.config import ConfigValueError, RouterReplaySettings
from jaxrl_llm.trainer.loop import RLTrainer
from tests.trainer import runs

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("ray") is not None
# The demo's settings on the tiny MoE (8 experts, top-2, both layers sparse); the dumped batch shows what
# the update replayed.
MOE = ("train.driver='inprocess'", "model.preset='tiny_moe'", "train.dump_batches=True")


def _one_step(tmp_path, *params):
    trainer = RLTrainer(runs.run_config(*MOE, *params, steps=1, run_dir=tmp_path))
    m = trainer.train_step(next(trainer.iterator), 0)
    with np.load(tmp_path / "batches" / "step_000000.npz") as f:
        batch = TrainBatch.from_arrays(dict(f))
    return trainer, m, batch


def _check_routing(batch, *, last_fed: bool):
    """Every token of every sequence has its experts (a response's last token only when the pass that
    recorded them fed it); nothing past the sequence."""
    routed = batch.fields["routed_experts"]  # [R, S, L_moe, k]
    assert routed.shape[2:] == (2, 2)
    for r, n in enumerate(batch.prompt_lengths + batch.response_lengths):
        fed = n if last_fed else n - 1
        assert (routed[r, :fed] >= 0).all() and (routed[r, :fed] < 8).all()
        assert (routed[r, fed:] == -1).all()
        assert (np.sort(routed[r, :fed], -1)[..., 0] != np.sort(routed[r, :fed], -1)[..., 1]).all()


def _check_step(m):
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/logprob_gap_mean", "training/rollout_probs_diff_mean"):
        assert np.isfinite(m[key]), key
    # fp32 sampler and trainer replaying its routing: the same numbers up to float reassociation.
    assert m["actor/logprob_gap_mean"] < 1e-4 and m["training/rollout_probs_diff_max"] < 1e-4


def test_grpo_step_with_rollout_routing_replay_from_the_dense_sampler(tmp_path):
    """R3 with the dense-cache sampler: its routing (the last response token never fed) reaches the update,
    whose log-probs then match the sampler's. (The paged sampler's R3 runs in the LoRA test below, R2 with
    the vLLM pool.)"""
    _, m, batch = _one_step(tmp_path, "rollout.kv_cache='dense'", "actor.router_replay.mode='R3'")
    _check_step(m)
    _check_routing(batch, last_fed=False)


def test_lora_grpo_step_with_replay_on_an_expert_mesh(tmp_path):
    """LoRA (all-linear: the attention) on the MoE, R3 with the paged sampler, experts split over 4 devices:
    the step runs, only the adapters are trained, and the sampler's log-probs match the update's."""
    trainer, m, batch = _one_step(tmp_path, "rollout.kv_cache='paged'", "actor.router_replay.mode='R3'",
                                  "model.lora_rank=4", "model.lora_alpha=8.0", "train.mesh_fsdp=2",
                                  "train.mesh_expert=4")
    _check_step(m)
    _check_routing(batch, last_fed=False)
    actor = trainer.worker.actor
    trained = jax.tree_util.tree_leaves_with_path(actor.state["params"])
    assert trained and all(p[-1].key in ("lora_a", "lora_b") and "self_attn" in str(p) for p, _ in trained)
    assert int(actor.state["step"]) > 0  # the update ran (the adapters' gradients: tests/models/test_lora_moe.py)


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and os.environ.get("JAXRL_REQUIRE_VLLM") != "1", reason="vllm is not installed")
def test_grpo_step_with_the_vllm_pool_and_its_moe_weight_updates(tmp_path):
    """One GRPO step with the vLLM pool and R2 (the old-log-prob pass records every token's experts: the
    update has two mini-batches, so the pass runs); the pool loads the updated MoE in place. Then new
    random weights through the pool's update: its greedy tokens equal the JAX engine's. (vLLM CPU
    prepacks the experts on the first load only; without the pool's re-pack they diverge.)"""
    import ray

    # head_dim 32: vLLM's CPU attention needs >= 32.
    trainer, m, batch = _one_step(tmp_path, "rollout.engine='vllm'", "actor.router_replay.mode='R2'",
                                  "data.max_response_length=8",
                                  "model.overrides={'vocab_size': 16, 'head_dim': 32, 'num_attention_heads': 2, "
                                  "'num_key_value_heads': 1}")
    try:
        _check_step(m)
        _check_routing(batch, last_fed=True)
        assert trainer.engine.pool.version == 1
        cfg = trainer.model_cfg
        params = init_params(cfg.replace(initializer_range=0.5), seed=7)
        prompts = [[2, 12, 7, 13], [3, 4, 5, 6, 8, 9, 10, 11], [14, 15], [9, 1, 4]]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        before = trainer.engine.pool.generate(prompts, greedy).tokens
        assert trainer.engine.pool.update_weights(params, step=5) == 5
        want = JaxEngine(cfg, params, dtype="float32", max_prompt_length=8).generate(prompts, greedy).tokens
        assert not np.array_equal(before, want)
        np.testing.assert_array_equal(trainer.engine.pool.generate(prompts, greedy).tokens, want)
        with pytest.raises(RolloutError, match=r"actor.router_replay.mode = 'R3'.*rollout.engine = 'jax'"):
            trainer.engine.pool.generate(prompts, greedy.replace(return_routed_experts=True))
    finally:
        trainer.engine.pool.shutdown()
        ray.shutdown()


def test_routing_replay_errors_name_the_key():
    with pytest.raises(UsageError, match=r"actor.router_replay.mode: 'R3'.*rollout.engine = 'jax'"):
        runs.run_config("actor.router_replay.mode='R3'", "rollout.engine='vllm'")
    with pytest.raises(UsageError, match=r"actor.router_replay.mode: 'R1'; use one of"):
        runs.run_config("actor.router_replay.mode='R1'")
    with pytest.raises(ConfigValueError, match=r"actor.router_replay.mode: 'R3' replays the sampler's"):
        RouterReplaySettings(mode="R3").validate("vllm")
    from jaxrl_llm.models import PRESETS

    with pytest.raises(ValueError, match=r"actor.router_replay.mode: 'R2' replays MoE routing.*'disabled'"):
        RouterReplaySettings(mode="R2").check_model(PRESETS["tiny"]())
    RouterReplaySettings(mode="R2").check_model(PRESETS["tiny_moe"]())
