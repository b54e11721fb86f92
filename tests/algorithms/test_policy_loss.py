"""Policy losses: PPO ("vanilla") by hand and against numpy, the registry, the config, and for every
registered loss the shared contract: shapes, metric keys, and exactness under micro-batching."""

import dataclasses
import functools

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
    agg_loss,
    compute_loss_norm,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    policy_loss_cov,
    policy_loss_variants,
    register_policy_loss,
    select_cov_tokens,
)
from tests.algorithms import numpy_reference_pg as ref_pg
from tests.algorithms.batches import random_batch
from tests.algorithms.pg_batches import COV_LOSSES, LOSS_NAMES, METRIC_KEYS, MODE_FREE_LOSSES, config_for, pg_batch

SPLITS = {2: (4,), 3: (2, 10)}  # split points of the B = 15 rows: sizes 4 + 11 and 2 + 8 + 5
_BUCKET = 11  # the rows every micro-batch is padded to


def _loss(**kw):
    return jax.jit(functools.partial(compute_policy_loss_vanilla, config=PolicyLossConfig(**kw)))


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


def test_hand_computed_gradient_and_weights():
    """Only unclipped tokens carry a gradient, -A·r·w/N; weights scale each token's loss."""
    ratio = np.array([[1.5, 0.5, 5.0, 1.1]], np.float32)
    adv = np.array([[1.0, 1.0, -1.0, -2.0]], np.float32)
    w = np.array([[2.0, 3.0, 1.0, 0.5]], np.float32)
    fn = lambda lp: compute_policy_loss_vanilla(jnp.zeros_like(lp), lp, adv, jnp.ones_like(lp),
                                                config=PolicyLossConfig(), rollout_is_weights=w)
    (loss, _), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(jnp.log(ratio))
    np.testing.assert_allclose(loss, (-1.2 * 2 - 0.5 * 3 + 3.0 * 1 + 2.2 * 0.5) / 4, rtol=1e-6)
    np.testing.assert_allclose(grad, [[0.0, -0.5 * 3 / 4, 0.0, 2.2 * 0.5 / 4]], rtol=1e-6)


def test_clip_higher():
    old = np.zeros((1, 2), np.float32)
    lp = np.log(np.array([[1.25, 0.75]], np.float32))
    loss, _ = _loss(clip_ratio_low=0.2, clip_ratio_high=0.28)(old, lp, np.ones_like(old), np.ones_like(old))
    # 1.25 < 1.28 is not clipped; with A > 0 the low clip (0.8) does not bind either (pessimistic max).
    np.testing.assert_allclose(loss, (-1.25 - 0.75) / 2, rtol=1e-6)


def test_dual_clip_bound_must_exceed_one():
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(x, x, x, x, config=PolicyLossConfig(clip_ratio_c=1.0))


def test_on_policy_ratio_one():
    b = random_batch(0)
    lp, adv, mask = b["old_log_prob"], b["advantages"], b["response_mask"]

    @jax.jit
    def check(lp):
        out = {}
        for mode in LOSS_AGG_MODES:
            cfg = PolicyLossConfig(loss_agg_mode=mode)
            loss_fn = lambda x, cfg=cfg: compute_policy_loss_vanilla(lp, x, adv, mask, config=cfg)
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
@pytest.mark.parametrize("weighted", [False, True])
def test_random_against_numpy_reference(mode, seed, weighted):
    b = pg_batch(seed)
    w = b["rollout_is_weights"] if weighted else None
    cfg = config_for("vanilla", mode)
    args = (b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"])
    fn = lambda lp: compute_policy_loss_vanilla(*args[:1], lp, *args[2:], config=cfg, rollout_is_weights=w)
    (loss, m), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(args[1])
    want_loss, want_m, want_grad = ref_pg.vanilla(*args, cfg, w)
    chex.assert_trees_all_close((loss, m, grad), (want_loss, want_m, want_grad), rtol=1e-5, atol=1e-6)
    assert 0 < float(m["pg_clipfrac"]) < 1 and 0 < float(m["pg_clipfrac_lower"]) < 1


def test_registry():
    want = {"vanilla": compute_policy_loss_vanilla, "clip_cov": policy_loss_cov.compute_policy_loss_clip_cov,
            "kl_cov": policy_loss_cov.compute_policy_loss_kl_cov}
    want.update({name: getattr(policy_loss_variants, f"compute_policy_loss_{name}")
                 for name in LOSS_NAMES if name not in want})
    for name, fn in want.items():
        assert get_policy_loss_fn(name) is fn and POLICY_LOSS_REGISTRY[name] is fn, name
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*vanilla"):
        get_policy_loss_fn("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a, **k: None)
    assert register_policy_loss("vanilla")(compute_policy_loss_vanilla) is compute_policy_loss_vanilla


def test_config_is_a_static_hashable_value():
    cfg = PolicyLossConfig(loss_mode="gspo", clip_ratio_high=0.28)
    assert hash(cfg) == hash(PolicyLossConfig(loss_mode="gspo", clip_ratio_high=0.28))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.loss_mode = "vanilla"
    x = np.zeros((2, 3), np.float32)
    fn = jax.jit(lambda cfg, *a: get_policy_loss_fn(cfg.loss_mode)(*a, config=cfg)[0], static_argnums=0)
    assert float(fn(cfg, x, x, x, np.ones_like(x))) == 0.0


def test_bf16_inputs_give_fp32_loss():
    b = pg_batch(0)
    args = [jnp.asarray(b[k], jnp.bfloat16) for k in ("old_log_prob", "log_prob", "advantages")]
    for name in LOSS_NAMES:
        loss, m = jax.jit(functools.partial(get_policy_loss_fn(name), config=config_for(name)))(
            *args, b["response_mask"])
        assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in m.values()), name


# ---- the shared contract of every registered loss -------------------------------------------------------


def _rows_padded(x, rows):
    """x[rows] followed by all-zero rows up to `_BUCKET` rows (zero mask: empty rows)."""
    return np.concatenate([x[rows], np.zeros((_BUCKET - len(rows),) + x.shape[1:], x.dtype)])


def _modes(name):
    return ("token-mean",) if name in MODE_FREE_LOSSES else LOSS_AGG_MODES


def _value_and_grad_all_modes(name, old, lp, adv, mask, w, select, norm):
    """{mode: (loss, metrics, d loss / d log_prob)} for every mode the loss honours."""
    out = {}
    for mode in _modes(name):
        fn = functools.partial(get_policy_loss_fn(name), config=config_for(name, mode))
        f = lambda x, fn=fn: fn(old, x, adv, mask, norm=norm, rollout_is_weights=w, token_select=select)
        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(lp)
        out[mode] = (loss, metrics, grad)
    return out


class SharedContractTest(chex.TestCase):
    """Every registered loss, jitted and not."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*LOSS_NAMES)
    def test_micro_batches_sum_to_the_mini_batch(self, name):
        """Uneven splits into 2 and 3 parts, each with the mini-batch's LossNorm (and, for the cov
        losses, its token selection): summed losses and metrics, and the gradients of the parts put
        side by side, equal the whole batch's. Rollout-correction weights included. Each part is
        padded with empty rows to 11 rows (as the trainer pads to a bucket, and to compile once),
        which differs from the whole batch's 15, so dividing by the row count would be caught."""
        b = pg_batch(3)
        old, lp, adv, mask, w = (b[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask",
                                                "rollout_is_weights"))
        select = None
        if name in COV_LOSSES:
            select = np.asarray(select_cov_tokens(old, lp, adv, mask, config_for(name), jax.random.key(7)))
            assert select.sum() >= 2
        norm = compute_loss_norm(mask)
        step = self.variant(functools.partial(_value_and_grad_all_modes, name))
        whole = step(old, lp, adv, mask, w, select, norm)
        for mode, (loss, metrics, grad) in whole.items():
            chex.assert_shape(loss, ())
            chex.assert_shape(grad, mask.shape)
            chex.assert_tree_all_finite((loss, metrics, grad))
            assert set(metrics) == METRIC_KEYS[name], (name, mode)
            chex.assert_shape(list(metrics.values()), ())
        for points in SPLITS.values():
            parts = []
            sizes = []
            for rows in np.split(np.arange(len(mask)), points):
                pad = functools.partial(_rows_padded, rows=rows)
                sel = None if select is None else pad(select)
                parts.append(step(pad(old), pad(lp), pad(adv), pad(mask), pad(w), sel, norm))
                sizes.append(len(rows))
            for mode, (loss, metrics, grad) in whole.items():
                summed = jax.tree.map(lambda *x: sum(x), *[(p[mode][0], p[mode][1]) for p in parts])
                stacked = np.concatenate([p[mode][2][:n] for p, n in zip(parts, sizes)])
                chex.assert_trees_all_close((*summed, stacked), (loss, metrics, grad), rtol=1e-5, atol=1e-6,
                                            custom_message=f"{name} {mode} {len(points) + 1} parts")

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*LOSS_NAMES)
    def test_whole_batch_norm_changes_nothing(self, name):
        """norm=None (the batch's own denominators, veRL's single-batch call) equals the explicit norm."""
        b = pg_batch(4)
        args = [b[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask", "rollout_is_weights")]
        select = None
        if name in COV_LOSSES:  # the loss's own selection uses jax.random.key(0)
            select = select_cov_tokens(*args[:4], config_for(name), jax.random.key(0))
        step = self.variant(functools.partial(_value_and_grad_all_modes, name))
        chex.assert_trees_all_close(step(*args, None, None), step(*args, select, compute_loss_norm(args[3])),
                                    rtol=1e-6, atol=1e-7)
