"""Loss aggregation modes: hand-computed cases, veRL 0.9.1 vs tunix on seq-mean-token-sum-norm, empty rows."""

import functools

import jax
import numpy as np
import pytest

from jaxrl_llm.algorithms import LOSS_AGG_MODES, agg_loss, compute_loss_norm, token_metric_mean
from tests.algorithms import numpy_reference as ref
from tests.algorithms.batches import random_batch

LOSS = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 1]], np.float32)


def _agg(mode, **kw):
    return jax.jit(functools.partial(agg_loss, loss_agg_mode=mode, **kw))


@pytest.mark.parametrize("mode, want", [
    ("token-mean", (1 + 2 + 4 + 5 + 6) / 5),
    ("token-sum", 1 + 2 + 4 + 5 + 6),
    ("seq-mean-token-sum", ((1 + 2) + (4 + 5 + 6)) / 2),
    ("seq-mean-token-mean", ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2) + (4 + 5 + 6)) / 2 / 3),  # / 2 sequences / loss scale factor T = 3
])
def test_hand_computed(mode, want):
    np.testing.assert_allclose(_agg(mode)(LOSS, MASK), want, rtol=1e-6)


def test_seq_mean_token_sum_norm_is_verl_0_9_1():
    """tunix's test case. veRL 0.9.1 divides by the sequences (2) and the padded length (3); older veRL
    divided by the padded length only, tunix's same-named mode by B only."""
    loss = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], np.float32)
    total = 0.1 + 0.2 + 0.4 + 0.5 + 0.6
    got = float(_agg("seq-mean-token-sum-norm")(loss, MASK))
    np.testing.assert_allclose(got, total / 2 / 3, rtol=1e-6)
    assert abs(got - total / 3) > 0.1  # older veRL
    assert abs(got - total / 2) > 0.1  # tunix's "sequence-mean-token-sum-norm"
    np.testing.assert_allclose(got, float(_agg("seq-mean-token-sum")(loss, MASK)) / 3, rtol=1e-6)


def test_seq_mean_token_sum_norm_uses_configured_max_len():
    norm = compute_loss_norm(MASK, max_len=8)
    np.testing.assert_allclose(_agg("seq-mean-token-sum-norm")(LOSS, MASK, norm=norm), 18 / 2 / 8, rtol=1e-6)


@pytest.mark.parametrize("mode, want", [("token-sum", 6.0 + 3.0 + 11.0), ("seq-mean-token-sum-norm", 20 / 3 / 4)])
def test_changed_modes_by_hand_and_split(mode, want):
    """Rows (1, 2, 3), (3), (5, 6) of a 4-wide batch; micro-batches of rows [0] and [1, 2] with the whole
    batch's norm add up to the whole batch's value."""
    loss = np.array([[1.0, 2.0, 3.0, 7.0], [3.0, 8.0, 8.0, 8.0], [5.0, 6.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], np.float32)
    norm = compute_loss_norm(mask)
    np.testing.assert_allclose(_agg(mode)(loss, mask), want, rtol=1e-6)
    parts = [_agg(mode)(loss[rows], mask[rows], norm=norm) for rows in ([0], [1, 2])]
    np.testing.assert_allclose(sum(float(p) for p in parts), want, rtol=1e-6)


def test_empty_rows_contribute_zero_and_are_not_counted():
    loss = np.array([[1.0, 2.0], [9.0, 9.0], [3.0, 5.0]], np.float32)
    mask = np.array([[1, 1], [0, 0], [1, 0]], np.float32)
    want = {"token-mean": 6 / 3, "token-sum": 6, "seq-mean-token-sum": (3 + 3) / 2,
            "seq-mean-token-mean": (1.5 + 3) / 2, "seq-mean-token-sum-norm": (3 + 3) / 2 / 2}
    for mode in LOSS_AGG_MODES:
        np.testing.assert_allclose(_agg(mode)(loss, mask), want[mode], rtol=1e-6, err_msg=mode)
        assert float(_agg(mode)(loss, np.zeros_like(mask))) == 0.0  # all empty: 0, not NaN


def test_nan_in_masked_slots_does_not_leak():
    loss = LOSS.copy()
    loss[0, 2] = np.nan
    for mode in LOSS_AGG_MODES:
        assert np.isfinite(float(_agg(mode)(loss, MASK))), mode


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_against_numpy_reference(mode, seed):
    b = random_batch(seed)
    np.testing.assert_allclose(_agg(mode)(b["advantages"], b["response_mask"]),
                               ref.agg_loss(b["advantages"], b["response_mask"], mode), rtol=1e-5, atol=1e-6)


def test_norm_of_the_whole_batch_changes_nothing():
    b = random_batch(2)
    norm = compute_loss_norm(b["response_mask"])
    for mode in LOSS_AGG_MODES:
        np.testing.assert_allclose(_agg(mode)(b["advantages"], b["response_mask"], norm=norm),
                                   _agg(mode)(b["advantages"], b["response_mask"]), rtol=1e-6)


def test_compute_loss_norm_counts():
    mask = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 0]], np.float32)
    norm = jax.jit(compute_loss_norm)(mask)
    assert (float(norm.num_tokens), float(norm.num_seqs), float(norm.max_len)) == (3.0, 2.0, 3.0)


def test_token_metric_mean():
    np.testing.assert_allclose(jax.jit(token_metric_mean)(LOSS, MASK), 18 / 5, rtol=1e-6)
    norm = compute_loss_norm(np.ones((4, 3)))
    np.testing.assert_allclose(jax.jit(token_metric_mean)(LOSS, MASK, norm), 18 / 12, rtol=1e-6)


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="invalid loss_agg_mode 'seq-mean'.*token-mean"):
        agg_loss(LOSS, MASK, "seq-mean")
