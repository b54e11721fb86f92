"""The old-log-prob pass is skipped exactly when the step is on-policy (one mini-batch, one epoch, nothing else
reading the old log-probs), and the update it gives equals the one from the pass's log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.algorithms import get_adv_estimator
from jaxrl_llm.trainer import steps
from jaxrl_llm.trainer.loop import RLTrainer, build_train_batch
from jaxrl_llm.trainer.roles.algo_setup import exactly_on_policy, rollout_correction_config
from tests.trainer import runs

ONE_MINI_BATCH = ("train.driver='inprocess'", "actor.ppo_mini_batch_size=8")  # FAST's train_batch_size is 8


@pytest.mark.parametrize("params,skipped", [
    ((), True),
    (("actor.ppo_mini_batch_size=4",), False),  # two mini-batches: the second is off-policy
    (("actor.ppo_epochs=2",), False),
    (("algorithm.use_kl_in_reward=True",), False),  # the reward's KL reads the old log-probs
    (("algorithm.rollout_correction.rollout_is='token'",), False),  # so do the IS weights
    (("algorithm.rollout_correction.bypass_mode=True",), False),  # the sampler's log-probs are the old ones
    (("algorithm.adv_estimator='optimal_token_baseline'",), False),  # Σπ² of the old pass
])
def test_the_pass_is_skipped_only_when_nothing_else_reads_the_old_log_probs(params, skipped):
    run = runs.run_config(*ONE_MINI_BATCH, *params)
    why = exactly_on_policy(run, get_adv_estimator(run.algo.adv_estimator), rollout_correction_config(run))
    assert (why is not None) == skipped


def test_the_skipped_pass_gives_the_same_update(tmp_path):
    trainer = RLTrainer(runs.run_config(*ONE_MINI_BATCH, "actor.entropy_coeff=0.01", run_dir=tmp_path / "run"))
    w = trainer.worker
    assert w.on_policy and not trainer.worker.needs_old_log_prob()
    prompts = next(trainer.iterator)
    batch = build_train_batch(prompts, trainer.engine.generate([p["prompt_ids"] for p in prompts], trainer.sampling(0)),
                              trainer.run.data.max_response_length)
    batch.fields["advantages"] = np.random.default_rng(0).standard_normal(batch.response_mask.shape).astype(
        np.float32) * batch.response_mask
    old = w.compute_log_prob(batch)["old_log_prob"]  # the pass the on-policy step skips
    start = jax.tree.map(jnp.copy, w.actor_state)

    skipped = w.update_actor(batch, 0)
    params_skipped = jax.device_get(w.actor_state["params"])

    # The same update with the pass's log-probs as the old ones.
    w.actor_state = start
    w.on_policy = False
    w.loss_settings = dataclasses.replace(w.loss_settings, on_policy=False)
    w.actor_grad = steps.make_grad_step(steps.actor_loss, w.actor_gd, w.actor_sh, s=w.loss_settings)
    w.actor_metrics0 = steps.make_metrics_init(steps.actor_loss, w.actor_gd, s=w.loss_settings)
    batch.fields["old_log_prob"] = old
    passed = w.update_actor(batch, 0)
    params_passed = jax.device_get(w.actor_state["params"])

    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        np.testing.assert_allclose(skipped[k], passed[k], rtol=1e-5, err_msg=k)
    assert skipped["actor/ppo_kl"] == 0.0 and abs(passed["actor/ppo_kl"]) < 1e-6
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params_skipped, params_passed)
