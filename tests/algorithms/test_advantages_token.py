"""Per-token advantage estimators (gae, reinforce_plus_plus, remax, optimal_token_baseline,
tir_optimal_token_baseline): hand-computed cases, the float64 loop reference on random batches,
invariants, with and without jit."""


import chex
import numpy as np
from absl.testing import parameterized

from jaxrl_llm.algorithms import (
    AdvantageConfig,
    compute_gae_advantage_return,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
)
from tests.algorithms import numpy_reference_adv as ref
from tests.algorithms.batches import SEEDS, TOL, EstimatorTest

OTB = compute_optimal_token_baseline_advantage
TIR = compute_multi_turn_optimal_token_baseline_advantage


def _whiten(x):
    x = np.asarray(x, np.float64)
    return (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8)


def _otb_inputs(b, with_weights):
    keys = ("index", "old_log_probs", "sum_pi_squared")
    return {**{k: b[k] for k in keys}, "rollout_is_weights": b["rollout_is_weights"] if with_weights else None}


class TokenEstimatorTest(EstimatorTest):

    # ---- GAE -----------------------------------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_gae_hand_computed_with_a_masked_middle_token(self):
        rewards = np.array([[0.0, 0.0, 1.0]], np.float32)
        values = np.array([[0.2, 0.5, 0.9]], np.float32)
        # gamma = lam = 1: raw advantages [0.8, 0.5, 0.1], returns are the reward-to-go.
        adv, ret = self._run(compute_gae_advantage_return, rewards, np.ones((1, 3), np.float32), values=values)
        np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0]], rtol=1e-6)
        np.testing.assert_allclose(adv[0], _whiten([0.8, 0.5, 0.1]), rtol=1e-5)
        # The masked middle token carries the next value (0.9) and GAE (0.1) through unchanged.
        adv, ret = self._run(compute_gae_advantage_return, rewards, np.array([[1, 0, 1]], np.float32), values=values)
        np.testing.assert_allclose(ret, [[0.8 + 0.2, 0.1 + 0.5, 0.1 + 0.9]], rtol=1e-6)
        np.testing.assert_allclose(adv[0, [0, 2]], _whiten([0.8, 0.1]), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_gae_against_reference(self, seed):
        b = ref.adv_batch(seed, holes=True)
        got = self._run(compute_gae_advantage_return, b["dense_rewards"], b["response_mask"], values=b["values"],
                        config=AdvantageConfig(gamma=0.99, lam=0.95))
        want = ref.gae(b["dense_rewards"], b["values"], b["response_mask"], 0.99, 0.95)
        chex.assert_trees_all_close(got, want, **TOL)

    # ---- REINFORCE++ ---------------------------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_reinforce_plus_plus_hand_computed(self):
        rewards = np.array([[0.0, 3.0, 1.0, 5.0]], np.float32)
        mask = np.array([[1, 0, 1, 0]], np.float32)  # an observation token, then padding with a stray reward
        adv, ret = self._run(compute_reinforce_plus_plus_outcome_advantage, rewards, mask,
                             config=AdvantageConfig(gamma=0.5))
        # Masked tokens are skipped: neither the 3 nor the 5 counts, and the return carries through.
        np.testing.assert_allclose(ret, [[0.5, 0.0, 1.0, 0.0]], rtol=1e-6)
        np.testing.assert_allclose(adv[0, [0, 2]], _whiten([0.5, 1.0]), rtol=1e-5)
        np.testing.assert_array_equal(adv[0, [1, 3]], 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_reinforce_plus_plus_against_reference(self, seed):
        b = ref.adv_batch(seed, holes=seed > 0)
        got = self._run(compute_reinforce_plus_plus_outcome_advantage, b["dense_rewards"], b["response_mask"],
                        config=AdvantageConfig(gamma=0.9))
        chex.assert_trees_all_close(got, ref.reinforce_pp(b["dense_rewards"], b["response_mask"], 0.9), **TOL)

    # ---- ReMax ---------------------------------------------------------------------------------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_remax_hand_computed(self):
        rewards = np.array([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]], np.float32)
        mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)  # the 5 sits on padding: dropped
        adv, ret = self._run(compute_remax_outcome_advantage, rewards, mask,
                             reward_baselines=np.array([0.4, 0.5], np.float32))
        np.testing.assert_allclose(ret, [[1, 1, 1], [2, 2, 0]], rtol=1e-6)
        np.testing.assert_allclose(adv, [[0.6, 0.6, 0.6], [1.5, 1.5, 0.0]], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_remax_against_reference(self, seed):
        b = ref.adv_batch(seed, holes=seed > 0)
        for rewards in (b["token_level_rewards"], b["dense_rewards"]):
            got = self._run(compute_remax_outcome_advantage, rewards, b["response_mask"],
                            reward_baselines=b["reward_baselines"])
            chex.assert_trees_all_close(got, ref.remax(rewards, b["response_mask"], b["reward_baselines"]), **TOL)
            adv, ret = got  # returns - advantages is the baseline on the mask
            np.testing.assert_allclose(ret - adv, b["reward_baselines"][:, None] * b["response_mask"], atol=1e-6)

    # ---- optimal token baseline ----------------------------------------------------------------------

    def _constant_policy(self, mask):
        """π_t = 0.5 and Σπ² = 0.5 on every token: w_t = 1 - 1 + 0.5 = 0.5."""
        return dict(old_log_probs=np.full(mask.shape, np.log(0.5), np.float32),
                    sum_pi_squared=np.full(mask.shape, 0.5, np.float32))

    @chex.variants(with_jit=True, without_jit=True)
    def test_otb_hand_computed(self):
        rewards = np.array([[0.0, 1.0], [0.0, 0.0]], np.float32)
        mask = np.array([[1, 1], [1, 0]], np.float32)
        inputs = dict(index=np.array([1, 1], np.int32), **self._constant_policy(mask))
        # W = [[0.5, 1.0], [0.5, 0.5]], G = [[1, 1], [0, 0]]. Column 0: B = (1·0.5 + 0·0.5) / 1 = 0.5;
        # column 1 has only row 0: B = 1. The zero tail drops row 0's baseline from column 1 on.
        adv, ret = self._run(OTB, rewards, mask, **inputs)
        np.testing.assert_allclose(ret, [[1, 1], [0, 0]])
        np.testing.assert_allclose(adv, [[0.5, 1.0], [-0.5, 0.0]], rtol=1e-6)
        adv, _ = self._run(OTB, rewards, mask, config=AdvantageConfig(handle_zero_tail=False), **inputs)
        np.testing.assert_allclose(adv, [[0.5, 0.0], [-0.5, 0.0]], atol=1e-6)
        # IS weights scale w by ρ²: ρ = 2 on row 1 makes column 0's B = (1·0.5) / (0.5 + 2) = 0.2.
        weights = np.array([[1, 1], [2, 2]], np.float32)
        adv, _ = self._run(OTB, rewards, mask, rollout_is_weights=weights, **inputs)
        np.testing.assert_allclose(adv, [[0.8, 1.0], [-0.2, 0.0]], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_tir_hand_computed_compares_kth_response_tokens(self):
        rewards = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], np.float32)
        mask = np.array([[1, 0, 1], [1, 1, 0]], np.float32)  # row 0 has an observation token in the middle
        inputs = dict(index=np.array([0, 0], np.int32), **self._constant_policy(mask))
        # Packed: W = [[0.5, 1.0], [0.5, 1.0]], G = [[1, 1], [0, 0]]: B = 0.5 at both slots.
        adv, ret = self._run(TIR, rewards, mask, **inputs)
        np.testing.assert_allclose(ret, [[1, 1, 1], [0, 0, 0]])
        np.testing.assert_allclose(adv, [[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]], rtol=1e-6)
        # By column instead, row 1's second token meets no response of row 0 (B = 0 there).
        adv, _ = self._run(OTB, rewards, mask, **inputs)
        np.testing.assert_allclose(adv, [[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]], atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        *[dict(testcase_name=f"seed{s}_{w}_{z}", seed=s, with_weights=w, zero_tail=z)
          for s in range(2) for w in (False, True) for z in (True, False)])
    def test_otb_and_tir_against_reference(self, seed, with_weights, zero_tail):
        config = AdvantageConfig(handle_zero_tail=zero_tail)
        # Single-turn masks with outcome rewards, multi-turn masks with dense rewards.
        for holes, rewards_key in ((False, "token_level_rewards"), (True, "dense_rewards")):
            b = ref.adv_batch(seed, holes=holes)
            inputs = _otb_inputs(b, with_weights)
            args = (b["index"], b["old_log_probs"], b["sum_pi_squared"], inputs["rollout_is_weights"], zero_tail)
            rewards = b[rewards_key]
            got = self._run(OTB, rewards, b["response_mask"], config=config, **inputs)
            want = ref.optimal_token_baseline(rewards, b["response_mask"], *args)
            chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)
            got = self._run(TIR, rewards, b["response_mask"], config=config, **inputs)
            want = ref.tir_optimal_token_baseline(rewards, b["response_mask"], *args)
            chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*SEEDS)
    def test_otb_invariants(self, seed):
        b = ref.adv_batch(seed)  # one run per row from column 0: single-turn
        mask, rewards = b["response_mask"], b["token_level_rewards"]
        inputs = _otb_inputs(b, with_weights=True)
        otb, ret = self._run(OTB, rewards, mask, **inputs)
        tir, tir_ret = self._run(TIR, rewards, mask, **inputs)
        np.testing.assert_allclose(tir, otb, atol=1e-6)  # single-turn: packing changes nothing
        np.testing.assert_array_equal(tir_ret, ret)
        np.testing.assert_array_equal(otb[mask == 0], 0.0)
        # A group of one has no baseline: its advantages are its returns.
        singletons = np.bincount(b["index"])[b["index"]] == 1
        np.testing.assert_allclose(otb[singletons], (ret * mask)[singletons])
        # All-ones IS weights change nothing.
        ones, _ = self._run(OTB, rewards, mask, **{**inputs, "rollout_is_weights": np.ones_like(mask)})
        none, _ = self._run(OTB, rewards, mask, **{**inputs, "rollout_is_weights": None})
        np.testing.assert_allclose(ones, none, atol=1e-6)
        # A deterministic policy (π = Σπ² = 1) has w = 0 everywhere, hence no baseline.
        det, _ = self._run(OTB, rewards, mask, index=b["index"], old_log_probs=np.zeros_like(mask),
                           sum_pi_squared=np.ones_like(mask))
        np.testing.assert_allclose(det, ret * mask, atol=1e-6)
