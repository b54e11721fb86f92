"""Every shipped gin recipe parses and validates (no model is loaded), with the seed run's values."""

import pathlib

import gin
import pytest

from jaxrl_llm.train import REPO_ROOT, parse_config

RECIPES = sorted(p.name for p in (pathlib.Path(REPO_ROOT) / "gin").glob("*.gin") if p.name != "base.gin")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_a_valid_run_config(name):
    gin.clear_config()
    run = parse_config([f"gin/{name}"], [])
    assert run.data.train_batch_size % run.actor.ppo_mini_batch_size == 0
    assert run.pack_length >= run.data.max_prompt_length + run.data.max_response_length


def test_seed_recipe_values():
    gin.clear_config()
    run = parse_config(["gin/grpo_qwen7b.gin"], [])
    assert (run.rollout.n, run.data.train_batch_size, run.data.max_prompt_length, run.data.max_response_length) == \
        (5, 1024, 512, 1024)
    assert run.actor.lr == 1e-6 and run.actor.use_kl_loss and run.actor.kl_loss_type == "low_var_kl"
    assert run.actor.kl_loss_coef == 0.001 and run.actor.entropy_coeff == 0.0 and run.trainer.total_epochs == 15
    assert run.algo.adv_estimator == "grpo" and run.trainer.mesh_fsdp == 8
    gin.clear_config()
    ppo = parse_config(["gin/ppo_qwen0p5b_1gpu.gin"], [])
    assert (ppo.data.train_batch_size, ppo.actor.ppo_mini_batch_size, ppo.actor.lr, ppo.critic.lr) == (128, 64, 1e-6,
                                                                                                       1e-5)
    assert (ppo.data.max_prompt_length, ppo.data.max_response_length, ppo.algo.adv_estimator) == (512, 256, "gae")


def test_dapo_recipe_is_the_seed_run_with_dapo():
    """veRL's DAPO recipe on the seed run: clip-higher, token-mean, no KL, dynamic sampling, overlong
    shaping (veRL's 4,096 of 20,480 tokens scaled to 1,024); everything else as the seed run."""
    gin.clear_config()
    seed = parse_config(["gin/grpo_qwen7b.gin"], [])
    gin.clear_config()
    run = parse_config(["gin/dapo_qwen7b.gin"], [])
    assert (run.actor.low, run.actor.high, run.actor.clip_ratio_c, run.actor.loss_agg_mode) == (0.2, 0.28, 10.0,
                                                                                                 "token-mean")
    assert not run.actor.use_kl_loss and not run.algo.use_kl_in_reward and run.algo.adv_estimator == "grpo"
    fg, ob = run.filter_groups, run.overlong_buffer
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (True, "reward", 10)
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 205, 1.0)
    assert ob.len == round(run.data.max_response_length * 4096 / 20480)
    assert (run.data, run.rollout, run.model) == (seed.data, seed.rollout, seed.model)
    assert (run.actor.lr, run.actor.ppo_mini_batch_size, run.trainer.mesh_fsdp) == (1e-6, 256, 8)
    assert run.trainer.experiment_name == "dapo_qwen2p5_7b_gsm8k"


@pytest.mark.parametrize("recipe,path,preset,family", [
    ("grpo_qwen3_8b.gin", "Qwen/Qwen3-8B", "qwen3_8b", "qwen3"),
    ("grpo_llama3p1_8b.gin", "meta-llama/Llama-3.1-8B-Instruct", "llama3p1_8b", "llama"),
])
def test_family_recipes_are_the_seed_run_with_another_model(recipe, path, preset, family):
    """Same values as the Qwen2.5-7B seed run; the model (and the run's names) differ; the preset that
    benchmarks use in its place (`model.preset`) is the same family and shape."""
    from jaxrl_llm.models import PRESETS
    from jaxrl_llm.trainer.roles.worker import model_config

    gin.clear_config()
    seed = parse_config(["gin/grpo_qwen7b.gin"], [])
    gin.clear_config()
    run = parse_config([f"gin/{recipe}"], [])
    assert run.model.path == path and run.trainer.experiment_name == recipe.removesuffix(".gin") + "_gsm8k"
    assert (run.rollout, run.actor, run.algo, run.data) == (seed.rollout, seed.actor, seed.algo, seed.data)
    gin.clear_config()
    bench = parse_config([f"gin/{recipe}"], ["model.path = None", f"model.preset = {preset!r}",
                                            "model.tokenizer_path = '/work/shared/data/qwen2_tokenizer'"])
    cfg = model_config(bench)
    assert cfg == PRESETS[preset](dtype="bfloat16", param_dtype="float32", remat="full")
    assert cfg.model_type == family
