"""Checks shared by the LoRA run tests (a compute-dtype base and an 8-bit one)."""

import jax
import numpy as np

from jaxrl_llm.trainer.rollout_batch import build_train_batch


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def check_the_engine_decodes_with_the_adapters(w, trainer, run, prompts, *, atol: float = 0.0) -> None:
    """After a sync the engine's weights are the base with the adapters merged in (to `atol`), and its
    log-probs of what it samples are the trainer's under the adapters, not the base's."""
    engine = trainer.engine
    engine.sync(1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=atol, rtol=0), host(engine.sampler.params),
                 host(engine.sampler._convert(w.actor.merged())))
    rollout = engine.generate([p["prompt_ids"] for p in prompts], trainer.sampling(1))
    batch = build_train_batch(prompts, rollout, run.data.max_response_length)
    now, base = w.compute_log_prob(batch)["old_log_prob"], w.compute_ref_log_prob(batch)
    np.testing.assert_allclose(now, batch.fields["rollout_log_probs"] * batch.response_mask, atol=1e-5)
    assert np.abs(now - base).max() > 1e-3
