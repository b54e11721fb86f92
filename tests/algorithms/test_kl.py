"""KL estimators (incl. straight-through "+"), KL in the reward, KL loss, and the controllers."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_kl_loss,
    compute_loss_norm,
    kl_penalty,
    make_kl_controller,
)
from tests.algorithms import numpy_reference as ref
from tests.algorithms.batches import random_batch

LP = np.array([[-1.0, -0.5, -2.0, -35.0]], np.float32)
REF = np.array([[-1.5, -0.5, -1.0, -2.0]], np.float32)  # d = lp - ref = [0.5, 0, -1, -33]


def _kl(name):
    return jax.jit(functools.partial(kl_penalty, kl_penalty=name))


def test_hand_computed():
    d = np.array([0.5, 0.0, -1.0, -33.0])
    np.testing.assert_allclose(_kl("kl")(LP, REF)[0], d, rtol=1e-6)
    np.testing.assert_allclose(_kl("abs")(LP, REF)[0], np.abs(d), rtol=1e-6)
    np.testing.assert_allclose(_kl("mse")(LP, REF)[0], d**2 / 2, rtol=1e-6)
    # k3 = exp(-d) + d - 1 with -d clamped to 20 and the result to 10 (the last entry).
    k3 = [np.exp(-0.5) + 0.5 - 1, 0.0, np.e - 2, 10.0]
    np.testing.assert_allclose(_kl("low_var_kl")(LP, REF)[0], k3, rtol=1e-6)


@pytest.mark.parametrize("name", KL_ESTIMATORS)
def test_random_against_numpy_reference(name):
    b = random_batch(0)
    np.testing.assert_allclose(_kl(name)(b["log_prob"], b["ref_log_prob"]),
                               ref.kl(b["log_prob"], b["ref_log_prob"], name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_straight_through_value_of_estimator_gradient_of_k2(name):
    b = random_batch(1)
    lp, rp = b["log_prob"], b["ref_log_prob"]
    np.testing.assert_allclose(_kl(name)(lp, rp), _kl(name[:-1])(lp, rp), rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(kl_penalty(x, rp, name) * jnp.cos(x))))(lp)
    # d/dx [sum ST(x) cos(x)] = dk2/dx cos(x) - k cos'(x) ... compare against the explicit form.
    k = ref.kl(lp, rp, name[:-1])
    np.testing.assert_allclose(grad, (lp - rp) * np.cos(lp) - k * np.sin(lp), rtol=1e-4, atol=1e-5)


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="unknown kl_penalty 'k4'.*low_var_kl"):
        kl_penalty(LP, REF, "k4")
    with pytest.raises(NotImplementedError):
        kl_penalty(LP, REF, "full")


def test_apply_kl_penalty_hand_computed():
    scores = np.array([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], np.float32)
    old = np.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], np.float32)
    refl = np.array([[-1.5, -1.0, -0.5], [-2.0, -1.0, 5.0]], np.float32)  # k1 = [.5, 0, -.5], [1, 0, x]
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    rewards, m = jax.jit(apply_kl_penalty)(scores, old, refl, mask, 0.1)
    np.testing.assert_allclose(rewards, [[-0.05, 0.0, 1.05], [-0.1, 2.0, 0.0]], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m["actor/reward_kl_penalty"], (0.0 + 0.5) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["actor/reward_kl_penalty_coeff"], 0.1)


@pytest.mark.parametrize("name", ["kl", "low_var_kl"])
def test_apply_kl_penalty_against_numpy_reference(name):
    b = random_batch(2)
    mask = b["response_mask"]
    rewards, m = jax.jit(functools.partial(apply_kl_penalty, kl_penalty=name))(
        b["token_level_rewards"], b["old_log_prob"], b["ref_log_prob"], mask, 0.05)
    kld = ref.kl(b["old_log_prob"], b["ref_log_prob"], name) * mask
    np.testing.assert_allclose(rewards, b["token_level_rewards"] - 0.05 * kld, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["actor/reward_kl_penalty"], ref.masked_mean(kld, mask, axis=-1).mean(),
                               rtol=1e-5, atol=1e-7)


def test_kl_loss_is_agg_of_kl_penalty():
    b = random_batch(3)
    norm = compute_loss_norm(b["response_mask"], max_len=10)
    fn = jax.jit(functools.partial(compute_kl_loss, kl_loss_type="k3+", loss_agg_mode="seq-mean-token-sum-norm"))
    want = agg_loss(ref.kl(b["log_prob"], b["ref_log_prob"], "k3"), b["response_mask"], "seq-mean-token-sum-norm",
                    norm=norm)
    np.testing.assert_allclose(fn(b["log_prob"], b["ref_log_prob"], b["response_mask"], norm=norm), want,
                               rtol=1e-5)


# ---- controllers -------------------------------------------------------------------------------------


def test_fixed_controller():
    ctrl = make_kl_controller("fixed", 0.2)
    ctrl.update(5.0, 100)
    assert isinstance(ctrl, FixedKLController) and ctrl.value == 0.2


def test_adaptive_controller_formula():
    ctrl = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(jnp.float32(0.1), n_steps=10)  # error clipped to +0.2
    np.testing.assert_allclose(ctrl.value, 0.1 * (1 + 0.2 * 10 / 100))
    ctrl.update(0.045, n_steps=50)  # error -0.1
    np.testing.assert_allclose(ctrl.value, 0.1 * 1.02 * (1 - 0.1 * 50 / 100))


def test_controller_state_round_trips_through_json():
    ctrl = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    ctrl.update(0.2, 7)
    state = json.loads(json.dumps(ctrl.state_dict()))
    fresh = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == ctrl.state_dict()
    fixed = make_kl_controller("fixed", 0.3)
    fixed.load_state_dict(json.loads(json.dumps({"type": "fixed", "value": 0.4})))
    assert fixed.value == 0.4
    with pytest.raises(ValueError, match="cannot load a 'adaptive'"):
        fixed.load_state_dict(state)


def test_make_kl_controller_errors():
    with pytest.raises(ValueError, match="target_kl and horizon"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        make_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="unknown KL controller type 'pid'"):
        make_kl_controller("pid", 0.1)
