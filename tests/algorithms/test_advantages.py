"""The advantage registry and its one calling convention, over every registered estimator; group ids.

The estimators' maths is tested in test_advantages_group.py and test_advantages_token.py."""

import functools

import chex
import jax
import numpy as np
import pytest
from absl.testing import parameterized

from jaxrl_llm.algorithms import (
    ADV_ESTIMATOR_REGISTRY,
    ADV_INPUTS,
    AdvantageConfig,
    AdvantageEstimator,
    AdvEstimator,
    compute_grpo_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    get_adv_estimator_fn,
    group_ids_from_uids,
    register_adv_est,
)
from tests.algorithms import numpy_reference_adv as ref

VERL_NAMES = [e.value for e in AdvantageEstimator]
# Estimators that do not multiply their advantages by the mask: gae whitens every token, as veRL.
UNMASKED = {"gae"}


def test_registry_holds_every_verl_estimator_with_known_inputs():
    assert len(VERL_NAMES) == 14
    assert set(VERL_NAMES) <= set(ADV_ESTIMATOR_REGISTRY)
    for name, est in ADV_ESTIMATOR_REGISTRY.items():
        assert isinstance(est, AdvEstimator)
        assert set(est.inputs) <= set(ADV_INPUTS), name
        assert len(set(est.inputs)) == len(est.inputs), name
    assert get_adv_estimator("grpo_vectorized") == get_adv_estimator("grpo") == (compute_grpo_outcome_advantage,
                                                                                  ("index",))
    assert get_adv_estimator(AdvantageEstimator.RLOO_VECTORIZED).fn is compute_rloo_outcome_advantage
    assert get_adv_estimator_fn("rloo") is compute_rloo_outcome_advantage
    assert get_adv_estimator("gae").inputs == ("values",)
    assert get_adv_estimator("reinforce_plus_plus").inputs == ()
    assert get_adv_estimator("remax").inputs == ("reward_baselines",)
    assert get_adv_estimator("gdpo").inputs == ("index", "reward_components")
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        assert get_adv_estimator(name).inputs == ("index", "old_log_probs", "sum_pi_squared", "rollout_is_weights")


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'.*grpo"):
        get_adv_estimator("nope")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        get_adv_estimator_fn("nope")
    register_adv_est("grpo", inputs=("index",))(compute_grpo_outcome_advantage)  # the same again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo", inputs=("index",))(lambda *a, **k: a)
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo", inputs=("index", "values"))(compute_grpo_outcome_advantage)
    with pytest.raises(ValueError, match="unknown advantage inputs \\['uid'\\]"):
        register_adv_est("test_bad", inputs=("uid",))
    assert get_adv_estimator("grpo").inputs == ("index",)


def test_register_custom_estimator():
    @register_adv_est("test_zero", inputs=("values",))
    def zero(token_level_rewards, response_mask, *, values, config=None):
        return response_mask * 0, values * response_mask

    try:
        assert get_adv_estimator("test_zero") == AdvEstimator(zero, ("values",))
        register_adv_est("test_zero_alias", inputs=("values",))(zero)  # one function, two names
        assert get_adv_estimator("test_zero_alias").fn is zero
    finally:
        del ADV_ESTIMATOR_REGISTRY["test_zero"]
        ADV_ESTIMATOR_REGISTRY.pop("test_zero_alias", None)


def test_config_is_hashable_and_static_under_jit():
    config = AdvantageConfig(gamma=0.9, gdpo_reward_keys=("a",), gdpo_reward_weights=(2.0,))
    assert hash(config) == hash(AdvantageConfig(gamma=0.9, gdpo_reward_keys=("a",), gdpo_reward_weights=(2.0,)))
    b = ref.adv_batch(0)
    fn = jax.jit(compute_grpo_outcome_advantage, static_argnames="config")
    adv, _ = fn(b["token_level_rewards"], b["response_mask"], index=b["index"],
                config=AdvantageConfig(norm_adv_by_std_in_grpo=False))
    np.testing.assert_allclose(adv, ref.grpo(b["token_level_rewards"], b["response_mask"], b["index"],
                                             norm_by_std=False), rtol=1e-5, atol=1e-5)


def test_group_ids_from_uids_are_dense_in_first_seen_order():
    ids = group_ids_from_uids(["b", "a", "b", "c", "a"])
    np.testing.assert_array_equal(ids, [0, 1, 0, 2, 1])
    assert ids.dtype == np.int32


class ConventionTest(chex.TestCase):
    """Every registered estimator, called exactly as the trainer does, on one batch holding every input."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*[(name, name) for name in sorted(ADV_ESTIMATOR_REGISTRY)])
    def test_call_through_the_convention(self, name):
        est = get_adv_estimator(name)
        # No group of one (grpo_passk needs two), but empty rows, an all-equal group, uneven groups.
        batch = ref.adv_batch(3, group_sizes=(2, 8, 3, 4, 2))
        config = AdvantageConfig(gamma=0.95, lam=0.9, gdpo_reward_keys=("accuracy", "format"))
        rewards, mask = batch["token_level_rewards"], batch["response_mask"]
        fn = self.variant(functools.partial(est.fn, config=config))
        adv, returns = fn(rewards, mask, **{k: batch[k] for k in est.inputs})
        chex.assert_shape((adv, returns), mask.shape)
        chex.assert_type((adv, returns), np.float32)
        chex.assert_tree_all_finite((adv, returns))
        if name not in UNMASKED:
            np.testing.assert_array_equal(np.asarray(adv)[mask == 0], 0.0)
        if "rollout_is_weights" in est.inputs:  # optional: None means no rollout correction
            adv_none, _ = fn(rewards, mask, **{k: batch[k] for k in est.inputs if k != "rollout_is_weights"},
                             rollout_is_weights=None)
            assert not np.allclose(adv_none, adv)
