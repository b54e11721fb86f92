"""DAPO's overlong penalty (veRL's overlong buffer), by hand and against a float64 loop."""

import numpy as np
import pytest

from jaxrl_llm.rewards import apply_overlong_penalty, compute_overlong_penalty, overlong_metrics


def test_penalty_by_hand():
    # budget 20, buffer 4: free up to 16 tokens, then -0.25 * factor a token, -factor at 20.
    lengths = np.array([1, 15, 16, 17, 18, 20])
    got = compute_overlong_penalty(lengths, max_response_length=20, buffer_len=4, penalty_factor=1.0)
    np.testing.assert_array_equal(got, [0.0, 0.0, 0.0, -0.25, -0.5, -1.0])
    half = compute_overlong_penalty(lengths, max_response_length=20, buffer_len=4, penalty_factor=0.5)
    np.testing.assert_array_equal(half, [0.0, 0.0, 0.0, -0.125, -0.25, -0.5])


def test_buffer_of_the_whole_budget_penalises_every_token():
    got = compute_overlong_penalty(np.array([0, 1, 3]), max_response_length=3, buffer_len=3, penalty_factor=1.0)
    np.testing.assert_allclose(got, [0.0, -1 / 3, -1.0])


def test_against_a_float64_loop():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 1025, size=500)
    scores = rng.random(500).astype(np.float32)
    shaped, extras = apply_overlong_penalty(scores, lengths, max_response_length=1024, buffer_len=205,
                                            penalty_factor=1.0, log=True)
    expected, penalties = [], []
    for score, n in zip(scores.tolist(), lengths.tolist()):
        p = min(-(n - (1024 - 205)) / 205 * 1.0, 0.0)
        penalties.append(p)
        expected.append(score + p)
    np.testing.assert_allclose(shaped, np.float32(expected), rtol=0, atol=0)
    assert shaped.dtype == np.float32
    np.testing.assert_allclose(extras["overlong_reward"], penalties, rtol=0, atol=1e-15)
    assert extras["overlong"] == [p < 0 for p in penalties] and any(extras["overlong"])


def test_extra_info_only_with_log_and_metrics():
    shaped, extras = apply_overlong_penalty(np.ones(3), np.array([1, 3, 4]), max_response_length=4, buffer_len=2,
                                            penalty_factor=1.0)
    assert extras == {} and overlong_metrics(extras) == {}
    np.testing.assert_array_equal(shaped, [1.0, 0.5, 0.0])
    _, extras = apply_overlong_penalty(np.ones(3), np.array([1, 3, 4]), max_response_length=4, buffer_len=2,
                                       penalty_factor=1.0, log=True)
    assert overlong_metrics(extras) == {"reward/overlong_reward/mean": -0.5, "reward/overlong_reward/min": -1.0,
                                        "reward/overlong/mean": 2 / 3}


@pytest.mark.parametrize("buffer_len", [0, -1, 5])
def test_bad_buffer_is_one_clear_error(buffer_len):
    with pytest.raises(ValueError, match="overlong_buffer_cfg.len"):
        compute_overlong_penalty(np.array([1]), max_response_length=4, buffer_len=buffer_len, penalty_factor=1.0)
