"""Clipped value loss: hand-computed case and the numpy reference."""

import functools

import jax
import numpy as np
import pytest

from jaxrl_llm.algorithms import LOSS_AGG_MODES, compute_value_loss
from tests.algorithms import numpy_reference as ref
from tests.algorithms.batches import random_batch


def test_hand_computed():
    vpreds = np.array([[1.0, 0.0, 2.0]], np.float32)
    values = np.array([[0.0, 0.0, 1.0]], np.float32)
    returns = np.array([[0.8, 1.0, 2.0]], np.float32)
    loss, clipfrac = jax.jit(compute_value_loss)(vpreds, returns, values, np.ones_like(vpreds), 0.5)
    # Token 0: clip(1, -.5, .5) = .5 -> max(.04, .09) = .09 (clipped wins); token 1: 1 both;
    # token 2: clip(2, .5, 1.5) = 1.5 -> max(0, .25) = .25 (clipped wins).
    np.testing.assert_allclose(loss, 0.5 * (0.09 + 1.0 + 0.25) / 3, rtol=1e-6)
    np.testing.assert_allclose(clipfrac, 2 / 3, rtol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_random_against_numpy_reference(mode):
    b = random_batch(0)
    fn = jax.jit(functools.partial(compute_value_loss, cliprange_value=0.3, loss_agg_mode=mode))
    got = fn(b["values"] + 0.5 * b["advantages"], b["returns"], b["values"], b["response_mask"])
    want = ref.value_loss(b["values"] + 0.5 * b["advantages"], b["returns"], b["values"], b["response_mask"], 0.3,
                          mode)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
