"""Rollout correction: hand-computed weights and masks, a float64 reference for every output and metric,
the bypass-mode loss (PPO-clip and REINFORCE), exact micro-batching, and config validation."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxrl_llm.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    compute_loss_norm,
    compute_offpolicy_metrics,
    compute_policy_loss_bypass_mode,
    compute_policy_loss_vanilla,
    compute_rollout_correction_and_rejection_mask,
    logprobs_from_logits,
)
from jaxrl_llm.algorithms.rollout_correction import RS_OPTIONS
from tests.algorithms import numpy_reference_rc as ref

RC = RolloutCorrectionConfig
TOL = dict(rtol=1e-4, atol=1e-5)
# Not additive over micro-batches (documented): each micro-batch reports its own, weighted by its share.
NOT_ADDITIVE = ("_std", "rollout_is_eff_sample_size")

_correct = jax.jit(compute_rollout_correction_and_rejection_mask, static_argnames="config")


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def _from_log_ratio(log_ratio, mask):
    """(old, rollout) log-probs with old - rollout = log_ratio on valid tokens, NaN on padding."""
    log_ratio, mask = np.asarray(log_ratio, np.float32), np.asarray(mask, np.float32)
    rollout = np.full(log_ratio.shape, -1.0, np.float32)
    old = rollout + log_ratio
    return np.where(mask > 0, old, np.nan).astype(np.float32), rollout, mask


# ---- hand-computed cases, jitted and not --------------------------------------------------------------

class HandComputedTest(chex.TestCase):

    def _run(self, log_ratio, mask, config):
        old, rollout, mask = _from_log_ratio(log_ratio, mask)
        fn = self.variant(compute_rollout_correction_and_rejection_mask, static_argnames="config")
        return _np(fn(old, rollout, mask, config=config))

    @chex.variants(with_jit=True, without_jit=True)
    def test_token_tis(self):
        ratio = np.array([[0.4, 1.0, 3.0, 1.5]])
        w, mask, m = self._run(np.log(ratio), np.ones((1, 4)), RC(rollout_is="token", rollout_is_threshold=2.0))
        np.testing.assert_allclose(w, [[0.4, 1.0, 2.0, 1.5]], rtol=1e-6)  # truncated at 2
        np.testing.assert_array_equal(mask, np.ones((1, 4)))
        np.testing.assert_allclose(m["rollout_corr/rollout_is_mean"], 4.9 / 4, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_max"], 2.0, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_min"], 0.4, rtol=1e-6)
        # raw 3 > 2 is high; raw 0.4 < 1/2 is low
        np.testing.assert_allclose(m["rollout_corr/rollout_is_ratio_fraction_high"], 0.25)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_ratio_fraction_low"], 0.25)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_std"], np.std([0.4, 1.0, 2.0, 1.5]), rtol=1e-5)
        ess = np.mean([0.4, 1.0, 2.0, 1.5]) ** 2 / np.mean(np.square([0.4, 1.0, 2.0, 1.5]))
        np.testing.assert_allclose(m["rollout_corr/rollout_is_eff_sample_size"], ess, rtol=1e-5)
        assert "rollout_corr/rollout_is_oob_ratio" not in m and "rollout_corr/rollout_is_batch_norm_factor" not in m

    @chex.variants(with_jit=True, without_jit=True)
    def test_token_icepop(self):
        ratio = np.array([[0.4, 1.0, 3.0, 1.5]])
        w, _, m = self._run(np.log(ratio), np.ones((1, 4)), RC(rollout_is="token", rollout_is_threshold="0.5_2"))
        np.testing.assert_allclose(w, [[0.0, 1.0, 0.0, 1.5]], rtol=1e-6)  # zeroed outside [0.5, 2]
        np.testing.assert_allclose(m["rollout_corr/rollout_is_oob_ratio"], 0.5)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_min"], 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_sequence_tis_and_padding(self):
        # Row sums of log r: log 3, log 0.25, log 1.2; the last row is padding.
        log_ratio = np.array([[np.log(3.0), 0.0, 0.0], [np.log(0.5), np.log(0.5), 0.0],
                              [np.log(1.2), 0.0, 0.0], [0.0, 0.0, 0.0]])
        mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])
        w, _, m = self._run(log_ratio, mask, RC(rollout_is="sequence", rollout_is_threshold=2.0))
        np.testing.assert_allclose(w, [[2, 2, 0], [0.25, 0.25, 0.25], [1.2, 0, 0], [0, 0, 0]], rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_max"], 3.0, rtol=1e-6)  # untruncated
        np.testing.assert_allclose(m["rollout_corr/rollout_is_min"], 0.25, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_mean"], (4 + 0.75 + 1.2) / 6, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 3, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_ratio_fraction_low"], 1 / 3, rtol=1e-6)
        # per-sequence weights 2, 0.25, 1.2 over the three non-empty rows
        np.testing.assert_allclose(m["rollout_corr/rollout_is_seq_mean"], 3.45 / 3, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_seq_std"], np.std([2, 0.25, 1.2], ddof=1), rtol=1e-5)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_seq_max_deviation"], 1.0, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_seq_fraction_high"], 1 / 3, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_sequence_icepop(self):
        log_ratio = np.array([[np.log(3.0), 0.0], [np.log(0.5), np.log(0.5)], [np.log(1.2), 0.0]])
        w, _, m = self._run(log_ratio, np.ones((3, 2)), RC(rollout_is="sequence", rollout_is_threshold="0.5_2.5"))
        np.testing.assert_allclose(w, [[0, 0], [0, 0], [1.2, 1.2]], rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_oob_ratio"], 4 / 6, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_batch_normalize(self):
        log_ratio = np.log(np.array([[0.5, 1.0, 1.5], [2.0, 1.0, 1.0]]))
        mask = np.array([[1, 1, 1], [1, 0, 0]])
        w, _, m = self._run(log_ratio, mask, RC(rollout_is="token", rollout_is_threshold=5.0,
                                                rollout_is_batch_normalize=True))
        np.testing.assert_allclose(m["rollout_corr/rollout_is_batch_norm_factor"], 5.0 / 4, rtol=1e-6)
        np.testing.assert_allclose(w, np.array([[0.5, 1.0, 1.5], [2.0, 0, 0]]) / 1.25, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_is_mean"], 1.25, rtol=1e-6)  # before normalising
        # sequence level: the mean of the per-sequence weights 0.75 and 2
        w, _, m = self._run(log_ratio, mask, RC(rollout_is="sequence", rollout_is_threshold=5.0,
                                                rollout_is_batch_normalize=True))
        np.testing.assert_allclose(m["rollout_corr/rollout_is_batch_norm_factor"], 1.375, rtol=1e-6)
        np.testing.assert_allclose(w, np.array([[0.75] * 3, [2.0, 0, 0]]) / 1.375, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_offpolicy_diagnostics(self):
        lp = np.array([[-1.0, -2.0], [-0.5, 0.0]], np.float32)
        rlp = np.array([[-1.5, -2.0], [-1.0, 0.0]], np.float32)
        mask = np.array([[1, 1], [1, 0]], np.float32)
        m = _np(self.variant(compute_offpolicy_metrics)(lp, rlp, mask))
        # per-row mean log-probs: training -1.5, -0.5; rollout -1.75, -1.0
        np.testing.assert_allclose(m["training_ppl"], (np.exp(1.5) + np.exp(0.5)) / 2, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_log_ppl"], (1.75 + 1.0) / 2, rtol=1e-6)
        np.testing.assert_allclose(m["kl"], (-0.5 + 0 - 0.5) / 3, rtol=1e-6)
        np.testing.assert_allclose(m["log_ppl_diff_max"], -0.25, rtol=1e-6)
        np.testing.assert_allclose(m["log_ppl_diff_min"], -0.5, rtol=1e-6)
        np.testing.assert_allclose(m["chi2_token"], (np.exp(1.0) + 1 + np.exp(1.0)) / 3 - 1, rtol=1e-6)
        np.testing.assert_allclose(m["chi2_seq"], (np.exp(1.0) + np.exp(1.0)) / 2 - 1, rtol=1e-6)


# Rows: small ratios; one big positive log r; two mildly negative ones; padding. Per-token divergences
# (k1 = -log r, k2 = (log r)²/2, k3 = r - 1 - log r) are worked out in the comments below.
RS_LOG_RATIO = np.array([[0.1, -0.1, 0.0], [1.0, 0.0, 0.0], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]])
RS_MASK = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 0, 0]])
RS_CASES = {
    # k1 in [log 0.5, log 2] = [-0.69, 0.69]: row 1's first token (k1 = -1) fails
    ("token_k1", "0.5_2.0"): [[1, 1, 1], [0, 1, 1], [1, 1, 0]],
    # k2: 0.5 (row 1) and 0.125 (row 2) exceed 0.1
    ("token_k2", 0.1): [[1, 1, 1], [0, 1, 1], [0, 0, 0]],
    # k3: e - 2 = 0.718 and e^-0.5 - 0.5 = 0.107 exceed 0.1
    ("token_k3", "0.1"): [[1, 1, 1], [0, 1, 1], [0, 0, 0]],
    # sums of k1: 0, -1, 1 against [-0.69, 0.69]
    ("seq_sum_k1", "0.5_2"): [[1, 1, 1], [0, 0, 0], [0, 0, 0]],
    # sums of k2: 0.01, 0.5, 0.25
    ("seq_sum_k2", 0.2): [[1, 1, 1], [0, 0, 0], [0, 0, 0]],
    # sums of k3: 0.01, 0.718, 0.213
    ("seq_sum_k3", 0.2): [[1, 1, 1], [0, 0, 0], [0, 0, 0]],
    # means of k1: 0, -1/3, 0.5; a single 1.5 means [log(1/1.5), log 1.5] = [-0.41, 0.41]
    ("seq_mean_k1", 1.5): [[1, 1, 1], [1, 1, 1], [0, 0, 0]],
    # means of k2: 0.0033, 0.167, 0.125
    ("seq_mean_k2", 0.15): [[1, 1, 1], [0, 0, 0], [1, 1, 0]],
    # means of k3: 0.0033, 0.239, 0.107
    ("seq_mean_k3", 0.15): [[1, 1, 1], [0, 0, 0], [1, 1, 0]],
    # max of k2: 0.005, 0.5, 0.125
    ("seq_max_k2", 0.2): [[1, 1, 1], [0, 0, 0], [1, 1, 0]],
    # max of k3: 0.005, 0.718, 0.107
    ("seq_max_k3", 0.1): [[1, 1, 1], [0, 0, 0], [0, 0, 0]],
}


class RejectionTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*RS_CASES)
    def test_each_mode(self, mode, spec):
        want = np.concatenate([np.array(RS_CASES[mode, spec], np.float32), np.zeros((1, 3), np.float32)])
        old, rollout, mask = _from_log_ratio(RS_LOG_RATIO, RS_MASK)
        fn = self.variant(compute_rollout_correction_and_rejection_mask, static_argnames="config")
        w, got, m = _np(fn(old, rollout, mask, config=RC(rollout_rs=mode, rollout_rs_threshold=spec)))
        assert w is None and got.dtype == mask.dtype
        np.testing.assert_array_equal(got, want)
        rejected_rows = [np.any((want[i] == 0) & (RS_MASK[i] > 0)) for i in range(3)]
        np.testing.assert_allclose(m["rollout_corr/rollout_rs_masked_fraction"], 1 - want.sum() / 8, rtol=1e-6)
        np.testing.assert_allclose(m[f"rollout_corr/rollout_rs_{mode}_masked_fraction"], 1 - want.sum() / 8,
                                   rtol=1e-6)
        # the padding row is not a sequence
        np.testing.assert_allclose(m["rollout_corr/rollout_rs_seq_masked_fraction"], np.mean(rejected_rows),
                                   rtol=1e-6)
        assert (f"rollout_corr/rollout_rs_{mode}_seq_fraction_low" in m) == mode.endswith("k1")

    @chex.variants(with_jit=True, without_jit=True)
    def test_modes_combine_and_duplicates_drop(self):
        old, rollout, mask = _from_log_ratio(RS_LOG_RATIO, RS_MASK)
        fn = self.variant(compute_rollout_correction_and_rejection_mask, static_argnames="config")
        config = RC(rollout_rs="token_k1, seq_max_k2,token_k1", rollout_rs_threshold="0.5_2.0,0.2")
        _, got, m = _np(fn(old, rollout, mask, config=config))
        want = np.array(RS_CASES["token_k1", "0.5_2.0"]) * np.array(RS_CASES["seq_max_k2", 0.2])
        np.testing.assert_array_equal(got[:3], want)
        np.testing.assert_allclose(m["rollout_corr/rollout_rs_token_k1_max"], 0.5, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_rs_token_k1_min"], -1.0, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_rs_seq_max_k2_max"], 0.5, rtol=1e-6)
        np.testing.assert_allclose(m["rollout_corr/rollout_rs_seq_max_k2_min"], 0.005, rtol=1e-5)


# ---- float64 reference on random batches -----------------------------------------------------------------

def _batch(seed=0, t=7):
    """Rows of lengths 0 (twice), 1 (twice) and more; a few log-ratios beyond the ±20 clamp; NaN padding."""
    rng = np.random.default_rng(seed)
    lengths = np.array([0, 7, 5, 1, 3, 6, 0, 2, 1, 7, 4, 3])
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    rollout = -np.abs(rng.normal(size=mask.shape)).astype(np.float32)
    old = (rollout + 0.3 * rng.normal(size=mask.shape)).astype(np.float32)
    old[1, 2], old[9, 0], old[5, 3] = rollout[1, 2] + 25.0, rollout[9, 0] - 25.0, rollout[5, 3] + 3.0
    old, rollout = np.where(mask > 0, old, np.nan), np.where(mask > 0, rollout, np.nan)
    return old.astype(np.float32), rollout.astype(np.float32), mask


ALL_RS = ",".join(RS_OPTIONS)
ALL_RS_THRESHOLDS = "0.7_1.4,0.05,0.05,0.5_2,0.3,0.3,1.2,0.04,0.04,0.1,0.1"
CONFIGS = {
    "off": RC(),
    "token_tis": RC(rollout_is="token", rollout_is_threshold=2.0),
    "token_icepop": RC(rollout_is="token", rollout_is_threshold="0.8_1.25"),
    "sequence_tis": RC(rollout_is="sequence", rollout_is_threshold="1.5"),
    "sequence_icepop": RC(rollout_is="sequence", rollout_is_threshold="0.5_2.0"),
    "token_normalized": RC(rollout_is="token", rollout_is_batch_normalize=True),
    "sequence_normalized": RC(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),
    "rs_all_modes": RC(rollout_rs=ALL_RS, rollout_rs_threshold=ALL_RS_THRESHOLDS),
    "rs_shared_threshold": RC(rollout_rs="token_k1,seq_mean_k1,token_k1", rollout_rs_threshold=1.3),
    "is_and_rs": RC(rollout_is="sequence", rollout_rs="seq_mean_k3,token_k2", rollout_rs_threshold="0.05,0.1"),
}


def _assert_metrics_close(got, want, tol=TOL):
    assert sorted(got) == sorted(want), set(got) ^ set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], err_msg=k, **tol)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_float64_reference(name, seed):
    config = CONFIGS[name]
    old, rollout, mask = _batch(seed)
    w, got_mask, metrics = _np(_correct(old, rollout, mask, config=config))
    want_w, want_mask, want_metrics = ref.rollout_correction(old, rollout, mask, config)
    assert (w is None) == (want_w is None)
    if w is not None:
        np.testing.assert_allclose(w, want_w, **TOL)
    np.testing.assert_array_equal(got_mask, want_mask)
    _assert_metrics_close(metrics, want_metrics)
    assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["token_tis", "sequence_icepop", "rs_all_modes", "is_and_rs"])
def test_norm_of_the_whole_batch_changes_nothing(name):
    old, rollout, mask = _batch(0)
    norm = compute_loss_norm(mask)
    chex.assert_trees_all_close(_correct(old, rollout, mask, config=CONFIGS[name], norm=norm),
                                _correct(old, rollout, mask, config=CONFIGS[name]), rtol=1e-6, atol=1e-7)


def test_offpolicy_metrics_match_reference():
    old, rollout, mask = _batch(2)
    got = _np(jax.jit(compute_offpolicy_metrics)(old, rollout, mask))
    _assert_metrics_close(got, ref.offpolicy_metrics(old, rollout, mask))


def test_some_rejection_happens():
    """The random batch exercises both outcomes of every mode (else the reference test proves little)."""
    old, rollout, mask = _batch(0)
    _, _, m = _np(_correct(old, rollout, mask, config=CONFIGS["rs_all_modes"]))
    for mode in RS_OPTIONS:
        assert 0 < m[f"rollout_corr/rollout_rs_{mode}_masked_fraction"] < 1, mode


def test_batch_normalize_refuses_a_micro_batch_norm():
    old, rollout, mask = _batch(0)
    with pytest.raises(ValueError, match="rollout_is_batch_normalize"):
        compute_rollout_correction_and_rejection_mask(old, rollout, mask, CONFIGS["token_normalized"],
                                                      norm=compute_loss_norm(mask))


# ---- bypass mode ----------------------------------------------------------------------------------------

D, V = 4, 9
BYPASS_RC = {
    "reinforce": RC(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5,
                    rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold="0.06,0.6_1.6"),
    "reinforce_seq_icepop": RC(bypass_mode=True, loss_type="reinforce", rollout_is="sequence",
                               rollout_is_threshold="0.5_2.0", rollout_rs="seq_max_k2", rollout_rs_threshold=0.1),
    "ppo_clip": RC(bypass_mode=True, rollout_is="sequence", rollout_rs="token_k3,seq_sum_k1",
                   rollout_rs_threshold="0.05,0.5_2.0"),
}


def _policy_problem(seed=0):
    """A linear policy (log-probs of `actions` under softmax(features @ W)), rollout log-probs near the
    current ones, and advantages; padding log-probs are finite (the PPO ratio's gradient needs it)."""
    rng = np.random.default_rng(seed)
    _, _, mask = _batch(seed)
    b, t = mask.shape
    params = rng.normal(size=(D, V)).astype(np.float32)
    batch = {"features": rng.normal(size=(b, t, D)).astype(np.float32),
             "actions": rng.integers(0, V, (b, t)).astype(np.int32),
             "advantages": rng.normal(size=(b, t)).astype(np.float32), "response_mask": mask}
    lp = np.asarray(_log_prob(params, batch))
    batch["rollout_log_probs"] = (lp + 0.3 * rng.normal(size=(b, t))).astype(np.float32)
    return params, batch


def _log_prob(params, batch):
    return logprobs_from_logits(batch["features"] @ params, batch["actions"])  # [B, T]


def _policy_config(rc, mode="token-mean", loss_mode="bypass_mode"):
    return PolicyLossConfig(loss_mode=loss_mode, loss_agg_mode=mode, clip_ratio_high=0.28, rollout_correction=rc)


@functools.partial(jax.jit, static_argnames="config")
def _bypass_step(params, batch, norm, config):
    def loss(p):
        return compute_policy_loss_bypass_mode(batch["rollout_log_probs"], _log_prob(p, batch), batch["advantages"],
                                               batch["response_mask"], config=config, norm=norm)
    return jax.value_and_grad(loss, has_aux=True)(params)


def test_registered():
    assert POLICY_LOSS_REGISTRY["bypass_mode"] is compute_policy_loss_bypass_mode


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_clip_is_vanilla_against_the_rollout_on_the_rejection_mask(mode):
    params, batch = _policy_problem(0)
    rc = BYPASS_RC["ppo_clip"]
    (loss, metrics), grad = _bypass_step(params, batch, None, _policy_config(rc, mode))
    lp = _log_prob(params, batch)
    _, mask, rc_metrics = _correct(lp, batch["rollout_log_probs"], batch["response_mask"], config=rc)
    assert 0 < float(jnp.sum(mask)) < float(np.sum(batch["response_mask"]))  # some tokens rejected

    def vanilla(p):  # no IS weights, although rollout_is is set: the ratio already is the IS ratio
        return compute_policy_loss_vanilla(batch["rollout_log_probs"], _log_prob(p, batch), batch["advantages"],
                                           mask, config=_policy_config(None, mode, "vanilla"))

    (want_loss, want_metrics), want_grad = jax.value_and_grad(vanilla, has_aux=True)(params)
    chex.assert_trees_all_close((loss, grad), (want_loss, want_grad), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(metrics, {**want_metrics, **rc_metrics}, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["reinforce", "reinforce_seq_icepop"])
def test_reinforce_matches_reference(name, mode):
    params, batch = _policy_problem(1)
    rc = BYPASS_RC[name]
    lp = np.asarray(_log_prob(params, batch))
    rollout, adv, mask = batch["rollout_log_probs"], batch["advantages"], batch["response_mask"]

    def loss(x):
        return compute_policy_loss_bypass_mode(rollout, x, adv, mask, config=_policy_config(rc, mode))

    (got, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(lp)
    weights, kept, rc_metrics = ref.rollout_correction(lp, rollout, mask, rc)
    assert 0 < kept.sum() < mask.sum()
    want, want_grad, ppo_kl = ref.reinforce(rollout, lp, adv, kept, weights, mode)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(grad, want_grad, **TOL)  # the weights carry no gradient
    np.testing.assert_allclose(metrics["ppo_kl"], ppo_kl, **TOL)
    _assert_metrics_close({k: v for k, v in metrics.items() if k != "ppo_kl"}, rc_metrics)


def _micro_batches(batch, split_points):
    """Uneven row splits, each padded with empty rows to the mini-batch's row count."""
    b = len(batch["response_mask"])
    for rows in np.split(np.arange(b), split_points):
        yield {k: np.concatenate([v[rows], np.zeros((b - len(rows),) + v.shape[1:], v.dtype)])
               for k, v in batch.items()}


def _combine(key, a, b):
    if key.endswith(("_max", "_max_deviation")):
        return jnp.maximum(a, b)
    if key.endswith("_min"):
        return jnp.minimum(a, b)
    return a + b


@pytest.mark.parametrize("split_points", [(5,), (2, 9)], ids=["k2", "k3"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", list(BYPASS_RC))
def test_micro_batches_add_up_to_the_mini_batch(name, mode, split_points):
    params, batch = _policy_problem(2)
    config = _policy_config(BYPASS_RC[name], mode)
    norm = compute_loss_norm(batch["response_mask"])
    (want_loss, want_metrics), want_grad = _bypass_step(params, batch, norm, config)
    loss, metrics, grad = 0.0, None, 0.0
    for micro in _micro_batches(batch, split_points):
        (micro_loss, m), g = _bypass_step(params, micro, norm, config)
        loss, grad = loss + micro_loss, grad + g
        metrics = m if metrics is None else {k: _combine(k, metrics[k], m[k]) for k in m}
    chex.assert_trees_all_close((loss, grad), (want_loss, want_grad), rtol=1e-5, atol=1e-6)
    assert sorted(metrics) == sorted(want_metrics)
    exact = {k: v for k, v in metrics.items() if not k.endswith(NOT_ADDITIVE)}
    assert len(exact) > 30, sorted(exact)
    chex.assert_trees_all_close(exact, {k: want_metrics[k] for k in exact}, rtol=1e-5, atol=1e-6)


def test_bypass_needs_the_rollout_correction_config():
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="rollout_correction"):
        compute_policy_loss_bypass_mode(x, x, x, x + 1, config=PolicyLossConfig(loss_mode="bypass_mode"))


# ---- validation -----------------------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(rollout_is="tok"), "rollout_is:"),
    (dict(rollout_is="token", rollout_is_threshold=None), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=""), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=-1.0), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=True), "rollout_is_threshold"),
    (dict(rollout_is="sequence", rollout_is_threshold="2_0.5"), "rollout_is_threshold: '2_0.5': lower bound >"),
    (dict(rollout_is="sequence", rollout_is_threshold="0.5_1_2"), "rollout_is_threshold"),
    (dict(rollout_is="sequence", rollout_is_threshold="0_2"), "rollout_is_threshold"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), "rollout_rs:"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=1.0), "rollout_rs:"),
    (dict(rollout_rs=" , ", rollout_rs_threshold=1.0), "rollout_rs:"),
    (dict(rollout_rs="token_k1"), "rollout_rs_threshold: required"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2_0.5"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="x_2"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="1,2,3"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=0), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=False), "rollout_rs_threshold"),
    (dict(loss_type="ppo"), "loss_type"),
    (dict(bypass_mode=True, rollout_is="token", rollout_is_batch_normalize=True), "rollout_is_batch_normalize"),
]


@pytest.mark.parametrize("kwargs, match", BAD_CONFIGS, ids=[str(c[0]) for c in BAD_CONFIGS])
def test_validate_rejects(kwargs, match):
    with pytest.raises(ValueError, match="algorithm.rollout_correction." + match.replace("(", r"\(")):
        RC(**kwargs).validate()
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="algorithm.rollout_correction"):  # the computation validates too
        _correct(x, x, x + 1, config=RC(**kwargs))


@pytest.mark.parametrize("config", [
    RC(), RC(rollout_is="token", rollout_is_threshold="inf"), RC(rollout_is_threshold="unused when IS is off"),
    RC(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"), RC(rollout_rs="token_k2", rollout_rs_threshold=2),
    *CONFIGS.values(), *BYPASS_RC.values()])
def test_validate_accepts(config):
    config.validate()
    hash(config)  # a static argument of jit


def test_infinite_threshold_means_no_truncation():
    old, rollout, mask = _batch(0)
    w, _, m = _np(_correct(old, rollout, mask, config=RC(rollout_is="token", rollout_is_threshold=math.inf)))
    np.testing.assert_allclose(w, np.where(mask > 0, np.exp(np.clip(np.nan_to_num(old - rollout), -20, 20)), 0),
                               rtol=1e-6)
    assert float(m["rollout_corr/rollout_is_ratio_fraction_low"]) == 0.0
