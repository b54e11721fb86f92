"""Entropy from logits: numpy reference, extreme logits, dtype."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.algorithms import compute_entropy_loss, entropy_from_logits
from tests.algorithms import numpy_reference as ref


def test_against_numpy_reference_and_uniform():
    logits = np.random.default_rng(0).normal(size=(3, 4, 11)).astype(np.float32) * 3
    np.testing.assert_allclose(jax.jit(entropy_from_logits)(logits), ref.entropy(logits), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(entropy_from_logits)(np.zeros((2, 7), np.float32)), np.log(7), rtol=1e-6)


def test_peaked_logits_stay_finite_and_bf16_gives_fp32():
    logits = jnp.asarray([[1e4, 0.0, -1e4], [50.0, 50.0, -1e30]], jnp.float32)
    h = jax.jit(entropy_from_logits)(logits)
    np.testing.assert_allclose(h, [0.0, np.log(2)], atol=5e-6)  # fp32 ulp at 50 is 4e-6
    assert jax.jit(entropy_from_logits)(logits.astype(jnp.bfloat16)).dtype == jnp.float32


def test_entropy_loss_aggregates():
    ent = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    mask = np.array([[1, 0], [1, 1]], np.float32)
    np.testing.assert_allclose(jax.jit(compute_entropy_loss)(ent, mask), 8 / 3, rtol=1e-6)
