"""Group-relative advantage estimators (grpo, rloo, reinforce_plus_plus_baseline, opo, gpg, grpo_passk,
gdpo): hand-computed cases, the float64 loop reference on random batches, invariants, with and
without jit."""


import chex
import jax
import numpy as np
from absl.testing import parameterized

from jaxrl_llm.algorithms import (
    AdvantageConfig,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from tests.algorithms import numpy_reference_adv as ref
from tests.algorithms.batches import SEEDS, TOL, EstimatorTest

NO_SINGLETONS = (2, 8, 3, 4, 2)


def _outcome(scores, t=2):
    """[B] scores on the last token of an all-ones [B, t] mask."""
    rewards = np.zeros((len(scores), t), np.float32)
    rewards[:, -1] = scores
    return rewards, np.ones_like(rewards)


def _whiten(x):
    x = np.asarray(x, np.float64)
    return (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8)


class GroupEstimatorTest(EstimatorTest):

    # ---- GRPO ----------------------------------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_hand_computed(self):
        rewards, mask = _outcome([1.0, 0.0, 1.0, 1.0, 0.0, 5.0])
        index = np.array([0, 0, 3, 3, 3, 5], np.int32)  # groups of 2, 3 and 1; ids need not be 0..G-1
        adv, ret = self._run(compute_grpo_outcome_advantage, rewards, mask, index=index)
        eps = 1e-6
        std2, std3 = np.sqrt(0.5), np.sqrt(1 / 3)  # unbiased stds of {1, 0} and {1, 1, 0}
        want = [0.5 / (std2 + eps), -0.5 / (std2 + eps), (1 / 3) / (std3 + eps), (1 / 3) / (std3 + eps),
                (-2 / 3) / (std3 + eps), 5.0 / (1 + eps)]  # the singleton keeps its raw score
        np.testing.assert_allclose(adv, np.array(want)[:, None] * mask, rtol=1e-6)
        np.testing.assert_array_equal(adv, ret)
        dr, _ = self._run(compute_grpo_outcome_advantage, rewards, mask, index=index,
                          config=AdvantageConfig(norm_adv_by_std_in_grpo=False))
        np.testing.assert_allclose(dr[:, 0], [0.5, -0.5, 1 / 3, 1 / 3, -2 / 3, 5.0], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_grpo_against_reference(self, seed):
        b = ref.adv_batch(seed)
        for norm in (True, False):
            config = AdvantageConfig(norm_adv_by_std_in_grpo=norm, epsilon=1e-4)
            adv, _ = self._run(compute_grpo_outcome_advantage, b["token_level_rewards"], b["response_mask"],
                               index=b["index"], config=config)
            want = ref.grpo(b["token_level_rewards"], b["response_mask"], b["index"], 1e-4, norm)
            np.testing.assert_allclose(adv, want, **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_all_equal_group_gives_exact_zero_and_groups_sum_to_zero(self):
        rewards, mask = _outcome([0.1] * 8 + [0.7] * 3)  # 0.1 is not exact in float32
        index = np.array([2] * 8 + [0] * 3, np.int32)
        adv, _ = self._run(compute_grpo_outcome_advantage, rewards, mask, index=index)
        assert np.all(adv == 0.0)
        b = ref.adv_batch(4, group_sizes=(2, 8, 3, 5), num_empty_rows=0)
        scores = np.random.default_rng(0).normal(size=len(b["index"])).astype(np.float32)
        rewards, mask = _outcome(scores)
        adv, _ = self._run(compute_grpo_outcome_advantage, rewards, mask, index=b["index"],
                           config=AdvantageConfig(epsilon=0.0))
        for g in np.unique(b["index"]):
            members = adv[b["index"] == g, 0]
            np.testing.assert_allclose(members.sum(), 0.0, atol=1e-5)
            np.testing.assert_allclose(members.std(ddof=1), 1.0, rtol=1e-4)

    # ---- RLOO and REINFORCE++ baseline ---------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_rloo_hand_computed(self):
        rewards, mask = _outcome([1.0, 0.0, 0.0, 4.0])
        adv, _ = self._run(compute_rloo_outcome_advantage, rewards, mask, index=np.array([1, 1, 1, 0], np.int32))
        # r - mean of the others: 1 - 0, 0 - 0.5, 0 - 0.5; the singleton keeps 4.
        np.testing.assert_allclose(adv[:, 0], [1.0, -0.5, -0.5, 4.0], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_reinforce_plus_plus_baseline_hand_computed(self):
        rewards, mask = _outcome([1.0, 0.0, 3.0], t=1)
        adv, _ = self._run(compute_reinforce_plus_plus_baseline_outcome_advantage, rewards, mask,
                           index=np.array([0, 0, 1], np.int32))
        np.testing.assert_allclose(adv[:, 0], _whiten([0.5, -0.5, 3.0]), rtol=1e-5)  # the singleton keeps 3

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_rloo_and_reinforce_plus_plus_baseline_against_reference(self, seed):
        b = ref.adv_batch(seed)
        args = (b["token_level_rewards"], b["response_mask"])
        adv, ret = self._run(compute_rloo_outcome_advantage, *args, index=b["index"])
        np.testing.assert_allclose(adv, ref.rloo(*args, b["index"]), **TOL)
        np.testing.assert_array_equal(adv, ret)
        adv, _ = self._run(compute_reinforce_plus_plus_baseline_outcome_advantage, *args, index=b["index"])
        np.testing.assert_allclose(adv, ref.reinforce_pp_baseline(*args, b["index"]), **TOL)

    # ---- OPO -----------------------------------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_opo_hand_computed(self):
        rewards = np.zeros((4, 3), np.float32)
        rewards[:, 0] = [1.0, 0.0, 2.0, 7.0]
        mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], np.float32)
        adv, _ = self._run(compute_opo_outcome_advantage, rewards, mask, index=np.array([0, 0, 0, 3], np.int32))
        baseline = (2 * 1.0 + 1 * 0.0 + 3 * 2.0) / 6  # length-weighted group mean
        want = np.array([1.0 - baseline, -baseline, 2.0 - baseline, 7.0])  # the singleton keeps 7
        np.testing.assert_allclose(adv, want[:, None] * mask, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_opo_against_reference(self, seed):
        b = ref.adv_batch(seed)
        adv, _ = self._run(compute_opo_outcome_advantage, b["token_level_rewards"], b["response_mask"],
                           index=b["index"])
        want = ref.opo(b["token_level_rewards"], b["response_mask"], b["index"])
        nan_rows = np.isnan(want).any(-1)
        assert nan_rows.sum() >= 2  # veRL's 0 / 0 on the group of empty rows ...
        np.testing.assert_array_equal(adv[nan_rows], 0.0)  # ... is 0 here
        np.testing.assert_allclose(adv[~nan_rows], want[~nan_rows], **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_opo_equals_dr_grpo_when_lengths_are_equal(self):
        b = ref.adv_batch(1, group_sizes=NO_SINGLETONS, num_empty_rows=0)
        mask = np.ones_like(b["response_mask"])
        opo, _ = self._run(compute_opo_outcome_advantage, b["token_level_rewards"], mask, index=b["index"])
        dr, _ = self._run(compute_grpo_outcome_advantage, b["token_level_rewards"], mask, index=b["index"],
                          config=AdvantageConfig(norm_adv_by_std_in_grpo=False))
        np.testing.assert_allclose(opo, dr, **TOL)

    # ---- GPG -----------------------------------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_gpg_hand_computed(self):
        rewards, mask = _outcome([1.0, 0.0, 0.0, 3.0])
        adv, _ = self._run(compute_gpg_outcome_advantage, rewards, mask, index=np.array([0, 0, 0, 1], np.int32))
        alpha = 4 / 2  # B / #non-zero scores
        np.testing.assert_allclose(adv[:, 0], alpha * np.array([2 / 3, -1 / 3, -1 / 3, 3.0]), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_gpg_against_reference(self, seed):
        b = ref.adv_batch(seed)
        adv, _ = self._run(compute_gpg_outcome_advantage, b["token_level_rewards"], b["response_mask"],
                           index=b["index"])
        np.testing.assert_allclose(adv, ref.gpg(b["token_level_rewards"], b["response_mask"], b["index"]), **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gpg_all_zero_scores_give_zero(self):
        rewards, mask = _outcome([0.0] * 5)
        adv, _ = self._run(compute_gpg_outcome_advantage, rewards, mask, index=np.array([0, 0, 1, 1, 4], np.int32))
        assert np.all(adv == 0.0)

    # ---- Pass@k --------------------------------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_passk_hand_computed(self):
        rewards, mask = _outcome([2.0, 0.5, 1.0, 1.0, 1.0, 0.0])
        index = np.array([0, 0, 0, 1, 1, 1], np.int32)
        adv, _ = self._run(compute_grpo_passk_outcome_advantage, rewards, mask, index=index)
        std = np.std([2.0, 0.5, 1.0], ddof=1)
        # Only the best gets best - second best; a tied best gives the whole group 0.
        np.testing.assert_allclose(adv[:, 0], [1.0 / (std + 1e-6), 0, 0, 0, 0, 0], rtol=1e-6)
        raw, _ = self._run(compute_grpo_passk_outcome_advantage, rewards, mask, index=index,
                           config=AdvantageConfig(norm_adv_by_std_in_grpo=False))
        np.testing.assert_allclose(raw[:, 0], [1.0, 0, 0, 0, 0, 0])

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_grpo_passk_against_reference(self, seed):
        b = ref.adv_batch(seed, group_sizes=NO_SINGLETONS)
        for norm in (True, False):
            adv, _ = self._run(compute_grpo_passk_outcome_advantage, b["token_level_rewards"], b["response_mask"],
                               index=b["index"], config=AdvantageConfig(norm_adv_by_std_in_grpo=norm))
            want = ref.grpo_passk(b["token_level_rewards"], b["response_mask"], b["index"], norm_by_std=norm)
            np.testing.assert_allclose(adv, want, **TOL)
            per_response = adv.max(-1) + adv.min(-1)
            assert np.all(per_response >= 0)
            for g in np.unique(b["index"]):
                assert np.count_nonzero(per_response[b["index"] == g]) <= 1

    def test_grpo_passk_group_of_one_raises_eagerly_and_gives_zero_under_jit(self):
        rewards, mask = _outcome([1.0, 0.0, 3.0])
        index = np.array([0, 0, 2], np.int32)
        with self.assertRaisesRegex(ValueError, r"at least 2 responses per group; group ids \[2\]"):
            compute_grpo_passk_outcome_advantage(rewards, mask, index=index)
        with self.assertRaisesRegex(ValueError, "two responses"):
            ref.grpo_passk(rewards, mask, index)
        adv, _ = jax.jit(compute_grpo_passk_outcome_advantage)(rewards, mask, index=index)
        np.testing.assert_allclose(adv[:, 0], [1.0 / (np.sqrt(0.5) + 1e-6), 0.0, 0.0], rtol=1e-6)

    # ---- GDPO ----------------------------------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_gdpo_hand_computed(self):
        mask = np.ones((4, 1), np.float32)
        components = {"acc": np.array([1.0, 0.0, 1.0, 1.0], np.float32),
                      "fmt": np.array([0.5, 0.5, 1.0, 0.0], np.float32), "unused": np.zeros(4, np.float32)}
        index = np.array([0, 0, 1, 1], np.int32)
        a = 0.5 / (np.sqrt(0.5) + 1e-6)  # GRPO of {1, 0} (and of {0.5, 0.5}: 0)
        acc, fmt = np.array([a, -a, 0, 0]), np.array([0, 0, a, -a])
        for weights, want in [(None, _whiten(acc + fmt)), ((1.0, 2.0), _whiten(acc + 2 * fmt))]:
            config = AdvantageConfig(gdpo_reward_keys=("acc", "fmt"), gdpo_reward_weights=weights)
            adv, ret = self._run(compute_gdpo_outcome_advantage, np.zeros_like(mask), mask, index=index,
                                 reward_components=components, config=config)
            np.testing.assert_allclose(adv[:, 0], want, rtol=1e-5)
            np.testing.assert_array_equal(adv, ret)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_gdpo_against_reference(self, seed):
        b = ref.adv_batch(seed)
        keys = ("accuracy", "format")
        for weights, norm in [(None, True), ((0.3, 1.7), True), ((1.0, 0.5), False)]:
            config = AdvantageConfig(gdpo_reward_keys=keys, gdpo_reward_weights=weights,
                                     norm_adv_by_std_in_grpo=norm)
            adv, _ = self._run(compute_gdpo_outcome_advantage, b["token_level_rewards"], b["response_mask"],
                               index=b["index"], reward_components=b["reward_components"], config=config)
            want = ref.gdpo(b["reward_components"], b["response_mask"], b["index"], keys, weights, norm_by_std=norm)
            np.testing.assert_allclose(adv, want, **TOL)
            np.testing.assert_array_equal(adv[b["response_mask"] == 0], 0.0)

    def test_gdpo_config_errors(self):
        b = ref.adv_batch(0)
        call = lambda config, components: compute_gdpo_outcome_advantage(
            b["token_level_rewards"], b["response_mask"], index=b["index"], reward_components=components,
            config=config)
        with self.assertRaisesRegex(ValueError, "gdpo_reward_keys"):
            call(AdvantageConfig(), b["reward_components"])
        with self.assertRaisesRegex(ValueError, r"\['length'\] are missing"):
            call(AdvantageConfig(gdpo_reward_keys=("accuracy", "length")), b["reward_components"])
        with self.assertRaisesRegex(ValueError, "1 entries for 2"):
            call(AdvantageConfig(gdpo_reward_keys=("accuracy", "format"), gdpo_reward_weights=(1.0,)),
                 b["reward_components"])

    # ---- shared invariants ---------------------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_every_group_estimator_is_zero_on_masked_tokens(self):
        b = ref.adv_batch(5, group_sizes=NO_SINGLETONS, holes=True)
        config = AdvantageConfig(gdpo_reward_keys=("accuracy", "format"))
        masked = b["response_mask"] == 0
        for fn in (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage,
                   compute_reinforce_plus_plus_baseline_outcome_advantage, compute_opo_outcome_advantage,
                   compute_gpg_outcome_advantage, compute_grpo_passk_outcome_advantage,
                   compute_gdpo_outcome_advantage):
            extra = {"reward_components": b["reward_components"]} if fn is compute_gdpo_outcome_advantage else {}
            adv, ret = self._run(fn, b["token_level_rewards"], b["response_mask"], index=b["index"], config=config,
                                 **extra)
            np.testing.assert_array_equal(adv[masked], 0.0, err_msg=fn.__name__)
            np.testing.assert_array_equal(adv, ret, err_msg=fn.__name__)
            assert np.all(np.isfinite(adv)), fn.__name__
