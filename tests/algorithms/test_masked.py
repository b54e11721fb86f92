"""Masked reductions against hand-computed values and the float64 numpy reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.algorithms import masked_mean, masked_sum, masked_var, masked_whiten
from tests.algorithms import numpy_reference as ref
from tests.algorithms.batches import random_batch

VALUES = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
MASK = np.array([[1, 1, 0], [1, 0, 0]], np.float32)  # selects 1, 2, 4


def test_hand_computed():
    mean, var = 7 / 3, (16 / 9 + 1 / 9 + 25 / 9) / 2  # unbiased over three elements
    np.testing.assert_allclose(jax.jit(masked_sum)(VALUES, MASK), 7.0)
    np.testing.assert_allclose(jax.jit(masked_mean)(VALUES, MASK), mean, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(masked_var)(VALUES, MASK), var, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda v, m: masked_var(v, m, unbiased=False))(VALUES, MASK),
                               var * 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(masked_whiten)(VALUES, MASK), (VALUES - mean) / np.sqrt(var + 1e-8),
                               rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda v, m: masked_whiten(v, m, shift_mean=False))(VALUES, MASK),
                               (VALUES - mean) / np.sqrt(var + 1e-8) + mean, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda v, m: masked_mean(v, m, axis=-1))(VALUES, MASK), [1.5, 4.0])


def test_bool_mask_and_nan_outside_mask():
    values = VALUES.copy()
    values[0, 2] = np.nan  # a masked slot may hold garbage
    out = jax.jit(masked_whiten)(values, MASK.astype(bool))
    assert np.all(np.isfinite(np.asarray(out)[MASK > 0]))
    np.testing.assert_allclose(jax.jit(masked_mean)(values, MASK.astype(bool)), 7 / 3, rtol=1e-6)


def test_empty_and_single_element_masks_are_finite():
    """veRL raises for these; under jit we return 0 (documented deviation)."""
    empty = np.zeros_like(MASK)
    assert float(jax.jit(masked_mean)(VALUES, empty)) == 0.0
    assert float(jax.jit(masked_var)(VALUES, empty)) == 0.0
    single = np.zeros_like(MASK)
    single[1, 1] = 1
    assert float(jax.jit(masked_var)(VALUES, single)) == 0.0
    assert float(jax.jit(masked_whiten)(VALUES, single)[1, 1]) == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_random_against_numpy_reference(seed):
    batch = random_batch(seed)
    x, m = batch["dense_rewards"], batch["response_mask"]
    chex.assert_trees_all_close(
        jax.jit(lambda x, m: (masked_mean(x, m), masked_mean(x, m, axis=-1), masked_var(x, m),
                              masked_whiten(x, m)))(x, m),
        (ref.masked_mean(x, m), ref.masked_mean(x, m, axis=-1), ref.masked_var(x, m), ref.masked_whiten(x, m)),
        rtol=1e-5, atol=1e-5)


def test_whitened_values_have_zero_mean_unit_variance():
    batch = random_batch(3)
    x, m = batch["dense_rewards"], batch["response_mask"]
    w = jax.jit(masked_whiten)(x, m)
    np.testing.assert_allclose(masked_mean(w, m), 0.0, atol=1e-6)
    np.testing.assert_allclose(masked_var(w, m), 1.0, rtol=1e-5)
    assert jnp.asarray(w).dtype == jnp.float32
