"""PPO clipped policy loss: hand-computed cases, numpy reference, on-policy invariants, registry."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    agg_loss,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
)
from tests.algorithms import numpy_reference as ref
from tests.algorithms.batches import random_batch


def _loss(**kw):
    return jax.jit(functools.partial(compute_policy_loss_vanilla, **kw))


def test_hand_computed_clip_and_dual_clip():
    ratio = np.array([[1.5, 0.5, 5.0, 0.5]], np.float32)
    adv = np.array([[1.0, 1.0, -1.0, -1.0]], np.float32)
    old = np.zeros_like(ratio)
    loss, m = _loss()(old, np.log(ratio), adv, np.ones_like(ratio))
    # A>0, r=1.5: clipped to 1.2 -> -1.2.   A>0, r=0.5: unclipped -> -0.5.
    # A<0, r=5: PPO gives 5, dual clip caps at c=3.   A<0, r=0.5: clipped to 0.8 -> 0.8.
    np.testing.assert_allclose(loss, (-1.2 - 0.5 + 3.0 + 0.8) / 4, rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac"], 2 / 4)
    np.testing.assert_allclose(m["pg_clipfrac_lower"], 1 / 4)
    np.testing.assert_allclose(m["ppo_kl"], -np.log(ratio).mean(), rtol=1e-6)


def test_clip_higher():
    old = np.zeros((1, 2), np.float32)
    lp = np.log(np.array([[1.25, 0.75]], np.float32))
    loss, _ = _loss(clip_ratio_low=0.2, clip_ratio_high=0.28)(old, lp, np.ones_like(old), np.ones_like(old))
    # 1.25 < 1.28 is not clipped; with A > 0 the low clip (0.8) does not bind either (pessimistic max).
    np.testing.assert_allclose(loss, (-1.25 - 0.75) / 2, rtol=1e-6)


def test_dual_clip_bound_must_exceed_one():
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(x, x, x, x, clip_ratio_c=1.0)


def test_on_policy_ratio_one():
    b = random_batch(0)
    lp, adv, mask = b["old_log_prob"], b["advantages"], b["response_mask"]

    @jax.jit
    def check(lp):
        out = {}
        for mode in LOSS_AGG_MODES:
            loss_fn = lambda x, mode=mode: compute_policy_loss_vanilla(lp, x, adv, mask, loss_agg_mode=mode)
            (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(lp)
            # On policy the loss is -A aggregated, and its gradient the policy gradient of -A·log_prob.
            pg_fn = lambda x, mode=mode: agg_loss(-adv * x, mask, mode)
            out[mode] = (loss, metrics, grad, agg_loss(-adv, mask, mode), jax.grad(pg_fn)(lp))
        return out

    for mode, (loss, m, grad, want_loss, want_grad) in check(lp).items():
        assert float(m["pg_clipfrac"]) == 0.0 and float(m["pg_clipfrac_lower"]) == 0.0, mode
        assert float(m["ppo_kl"]) == 0.0, mode
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6, err_msg=mode)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-7, err_msg=mode)


def test_extreme_log_ratio_is_clamped():
    old = np.zeros((1, 2), np.float32)
    lp = np.array([[80.0, -80.0]], np.float32)
    loss, m = _loss()(old, lp, np.array([[-1.0, 1.0]], np.float32), np.ones_like(old))
    assert np.isfinite(float(loss)) and np.isfinite(float(m["ppo_kl"]))
    np.testing.assert_allclose(m["ppo_kl"], 0.0, atol=1e-6)  # clamped to +-20, symmetric


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_against_numpy_reference(mode, seed):
    b = random_batch(seed)
    lp = b["old_log_prob"] + 6.0 * (b["log_prob"] - b["old_log_prob"])  # wide ratios: all clip paths
    loss, m = _loss(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.5, loss_agg_mode=mode)(
        b["old_log_prob"], lp, b["advantages"], b["response_mask"])
    want = ref.policy_loss_vanilla(b["old_log_prob"], lp, b["advantages"], b["response_mask"], 0.2, 0.28, 2.5,
                                   mode)
    chex.assert_trees_all_close((loss, m["pg_clipfrac"], m["pg_clipfrac_lower"], m["ppo_kl"]), want,
                                rtol=1e-5, atol=1e-6)
    assert 0 < float(m["pg_clipfrac"]) < 1 and 0 < float(m["pg_clipfrac_lower"]) < 1


def test_registry():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla
    assert "vanilla" in POLICY_LOSS_REGISTRY
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*vanilla"):
        get_policy_loss_fn("ppo2")


def test_bf16_inputs_give_fp32_loss():
    b = random_batch(0)
    args = [jnp.asarray(b[k], jnp.bfloat16) for k in ("old_log_prob", "log_prob", "advantages")]
    loss, m = _loss()(*args, b["response_mask"])
    assert loss.dtype == jnp.float32 and m["ppo_kl"].dtype == jnp.float32
