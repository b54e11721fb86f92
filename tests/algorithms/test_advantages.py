"""Advantage estimators: hand-computed cases, the float64 numpy reference (veRL's loops), invariants."""

import functools

import chex
import jax
import numpy as np
import pytest

from jaxrl_llm.algorithms import (
    ADV_ESTIMATOR_REGISTRY,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    group_ids_from_uids,
    register_adv_est,
)
from tests.algorithms import numpy_reference as ref
from tests.algorithms.batches import random_batch

TOL = dict(rtol=1e-5, atol=1e-5)


def _outcome(scores, t=2):
    """[B] scores on the last token of an all-ones [B, t] mask."""
    rewards = np.zeros((len(scores), t), np.float32)
    rewards[:, -1] = scores
    return rewards, np.ones_like(rewards)


# ---- GRPO --------------------------------------------------------------------------------------------


def test_grpo_hand_computed():
    rewards, mask = _outcome([1.0, 0.0, 1.0, 1.0, 0.0, 5.0])
    index = np.array([0, 0, 3, 3, 3, 5], np.int32)  # groups of 2, 3 and 1; ids need not be 0..G-1
    adv, ret = jax.jit(compute_grpo_outcome_advantage)(rewards, mask, index)
    eps = 1e-6
    std2, std3 = np.sqrt(0.5), np.sqrt(1 / 3)  # unbiased stds of {1, 0} and {1, 1, 0}
    want = [0.5 / (std2 + eps), -0.5 / (std2 + eps), (1 / 3) / (std3 + eps), (1 / 3) / (std3 + eps),
            (-2 / 3) / (std3 + eps), 5.0 / (1 + eps)]  # the singleton keeps its raw score
    np.testing.assert_allclose(adv, np.array(want)[:, None] * mask, rtol=1e-6)
    chex.assert_trees_all_equal(adv, ret)

    dr, _ = jax.jit(functools.partial(compute_grpo_outcome_advantage, norm_adv_by_std_in_grpo=False))(
        rewards, mask, index)
    np.testing.assert_allclose(dr[:, 0], [0.5, -0.5, 1 / 3, 1 / 3, -2 / 3, 5.0], rtol=1e-6)


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_against_numpy_reference(seed, norm_by_std):
    b = random_batch(seed)
    fn = jax.jit(functools.partial(compute_grpo_outcome_advantage, norm_adv_by_std_in_grpo=norm_by_std))
    adv, _ = fn(b["token_level_rewards"], b["response_mask"], b["index"])
    want = ref.grpo(b["token_level_rewards"], b["response_mask"], b["index"], norm_by_std=norm_by_std)
    np.testing.assert_allclose(adv, want, **TOL)


def test_grpo_all_equal_group_gives_exact_zero():
    rewards, mask = _outcome([0.1] * 8 + [0.7] * 3)  # 0.1 is not exact in float32
    index = np.array([2] * 8 + [0] * 3, np.int32)
    adv, _ = jax.jit(compute_grpo_outcome_advantage)(rewards, mask, index)
    assert np.all(np.asarray(adv) == 0.0)


def test_grpo_advantages_sum_to_zero_within_each_group():
    b = random_batch(4, group_sizes=(2, 8, 3, 5))
    scores = np.random.default_rng(0).normal(size=len(b["index"])).astype(np.float32)
    rewards, mask = _outcome(scores)
    adv, _ = jax.jit(compute_grpo_outcome_advantage)(rewards, mask, b["index"])
    for g in np.unique(b["index"]):
        members = np.asarray(adv)[b["index"] == g, 0]
        np.testing.assert_allclose(members.sum(), 0.0, atol=1e-5)
        np.testing.assert_allclose(members.std(ddof=1), 1.0, rtol=1e-4)  # unit std (up to eps)


# ---- RLOO --------------------------------------------------------------------------------------------


def test_rloo_hand_computed():
    rewards, mask = _outcome([1.0, 0.0, 0.0, 4.0])
    index = np.array([1, 1, 1, 0], np.int32)
    adv, _ = jax.jit(compute_rloo_outcome_advantage)(rewards, mask, index)
    # r - mean of the others: 1 - 0, 0 - 0.5, 0 - 0.5; the singleton keeps 4.
    np.testing.assert_allclose(adv[:, 0], [1.0, -0.5, -0.5, 4.0], rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_rloo_against_numpy_reference(seed):
    b = random_batch(seed)
    adv, ret = jax.jit(compute_rloo_outcome_advantage)(b["token_level_rewards"], b["response_mask"], b["index"])
    np.testing.assert_allclose(adv, ref.rloo(b["token_level_rewards"], b["response_mask"], b["index"]), **TOL)
    chex.assert_trees_all_equal(adv, ret)


# ---- GAE ---------------------------------------------------------------------------------------------


def test_gae_hand_computed_with_a_masked_middle_token():
    rewards = np.array([[0.0, 0.0, 1.0]], np.float32)
    values = np.array([[0.2, 0.5, 0.9]], np.float32)
    gae = jax.jit(compute_gae_advantage_return)
    # gamma = lam = 1: raw advantages [0.8, 0.5, 0.1], returns are the reward-to-go.
    adv, ret = gae(rewards, values, np.ones((1, 3), np.float32), 1.0, 1.0)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0]], rtol=1e-6)
    raw = np.array([0.8, 0.5, 0.1])
    np.testing.assert_allclose(adv[0], (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8), rtol=1e-5)
    # The masked middle token carries the next value (0.9) and GAE (0.1) through unchanged.
    adv, ret = gae(rewards, values, np.array([[1, 0, 1]], np.float32), 1.0, 1.0)
    np.testing.assert_allclose(ret, [[0.8 + 0.2, 0.1 + 0.5, 0.1 + 0.9]], rtol=1e-6)
    raw = np.array([0.8, 0.1])  # the selected raw advantages
    np.testing.assert_allclose(adv[0, [0, 2]], (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8), rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_gae_against_numpy_reference(seed):
    b = random_batch(seed)
    # Scatter some holes into the masks, as multi-turn observation tokens would be.
    mask = b["response_mask"] * (np.random.default_rng(seed).random(b["response_mask"].shape) > 0.2)
    got = jax.jit(compute_gae_advantage_return)(b["dense_rewards"], b["values"], mask, 0.99, 0.95)
    want = ref.gae(b["dense_rewards"], b["values"], mask, 0.99, 0.95)
    chex.assert_trees_all_close(got, want, **TOL)


# ---- REINFORCE++ -------------------------------------------------------------------------------------


def test_reinforce_plus_plus_hand_computed():
    rewards = np.array([[0.0, 0.0, 1.0, 5.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], np.float32)  # the 5 after EOS must not leak back
    adv, ret = jax.jit(compute_reinforce_plus_plus_outcome_advantage)(rewards, mask, 0.5)
    np.testing.assert_allclose(ret, [[0.25, 0.5, 1.0, 5.0]], rtol=1e-6)
    sel = np.array([0.25, 0.5, 1.0])
    np.testing.assert_allclose(adv[0, :3], (sel - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8), rtol=1e-5)
    assert float(adv[0, 3]) == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_plus_plus_against_numpy_reference(seed):
    b = random_batch(seed)
    got = jax.jit(compute_reinforce_plus_plus_outcome_advantage)(b["dense_rewards"], b["response_mask"], 0.9)
    chex.assert_trees_all_close(got, ref.reinforce_pp(b["dense_rewards"], b["response_mask"], 0.9), **TOL)


def test_reinforce_plus_plus_baseline_hand_computed():
    rewards, mask = _outcome([1.0, 0.0, 3.0], t=1)
    index = np.array([0, 0, 1], np.int32)
    adv, _ = jax.jit(compute_reinforce_plus_plus_baseline_outcome_advantage)(rewards, mask, index)
    centred = np.array([0.5, -0.5, 3.0])  # the singleton keeps its score
    want = (centred - centred.mean()) / np.sqrt(centred.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(adv[:, 0], want, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_plus_plus_baseline_against_numpy_reference(seed):
    b = random_batch(seed)
    fn = jax.jit(compute_reinforce_plus_plus_baseline_outcome_advantage)
    adv, _ = fn(b["token_level_rewards"], b["response_mask"], b["index"])
    want = ref.reinforce_pp_baseline(b["token_level_rewards"], b["response_mask"], b["index"])
    np.testing.assert_allclose(adv, want, **TOL)


# ---- group ids and registry --------------------------------------------------------------------------


def test_group_ids_from_uids_are_dense_in_first_seen_order():
    ids = group_ids_from_uids(["b", "a", "b", "c", "a"])
    np.testing.assert_array_equal(ids, [0, 1, 0, 2, 1])
    assert ids.dtype == np.int32


def test_registry_has_verl_names_and_clear_errors():
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(
        ADV_ESTIMATOR_REGISTRY)
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'.*grpo"):
        get_adv_estimator_fn("nope")
    register_adv_est("grpo")(compute_grpo_outcome_advantage)  # re-registering the same fn is fine
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo")(lambda *a: a)


def test_register_custom_estimator():
    @register_adv_est("test_zero")
    def zero(token_level_rewards, response_mask, index):
        return response_mask * 0, response_mask * 0

    try:
        assert get_adv_estimator_fn("test_zero") is zero
    finally:
        del ADV_ESTIMATOR_REGISTRY["test_zero"]
