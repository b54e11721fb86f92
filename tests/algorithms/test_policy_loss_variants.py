"""veRL's policy losses beyond vanilla: hand-computed cases, float64 numpy references (loss, metrics and
gradient), and the clip_cov / kl_cov token selection."""

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
    PolicyLossConfig,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    get_policy_loss_fn,
    select_cov_tokens,
)
from tests.algorithms import numpy_reference_pg as ref_pg
from tests.algorithms.pg_batches import LOSS_NAMES, MODE_FREE_LOSSES, config_for, pg_batch

f32 = lambda *rows: np.array(rows, np.float32)


def _run(fn, old, lp, adv, mask=None, **kw):
    """(loss, metrics, d loss / d log_prob) of a jitted loss on small hand-made arrays."""
    mask = np.ones_like(lp) if mask is None else mask
    f = lambda x: fn(old, x, adv, mask, **kw)
    (loss, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(lp))
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


# ---- hand-computed cases ---------------------------------------------------------------------------------


def test_gspo_by_hand():
    """Row 1: log-ratios +-log 2 average to 0, so s = 1 and each token is -A. Row 2: s = 1.5 is
    clipped to 1.28 for A > 0, and its tokens lose their gradient."""
    old = np.zeros((2, 2), np.float32)
    lp = np.log(f32([2.0, 0.5], [1.5, 1.5]))
    adv = f32([1.0, -1.0], [1.0, 1.0])
    loss, m, grad = _run(compute_policy_loss_gspo, old, lp, adv, config=PolicyLossConfig(clip_ratio_high=0.28))
    np.testing.assert_allclose(loss, (-1 + 1 - 1.28 - 1.28) / 4, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-1 / 4, 1 / 4], [0, 0]], atol=1e-7)
    np.testing.assert_allclose([m["pg_clipfrac"], m["pg_clipfrac_lower"]], [2 / 4, 0.0])
    np.testing.assert_allclose(m["ppo_kl"], -2 * math.log(1.5) / 4, rtol=1e-6)


def test_gspo_log_ratio_capped_at_10_from_above_only():
    """Row 1: log s = 12 is capped at 10 (no gradient); -A·e^10 wins for A < 0. Row 2: log s = -12 is
    not clamped, and -A·s wins for A > 0, with gradient -A·s."""
    old, lp, adv = np.zeros((2, 1), np.float32), f32([12.0], [-12.0]), f32([-1.0], [1.0])
    loss, _, grad = _run(compute_policy_loss_gspo, old, lp, adv, config=PolicyLossConfig())
    np.testing.assert_allclose(loss, (math.exp(10.0) - math.exp(-12.0)) / 2, rtol=1e-6)
    np.testing.assert_allclose(grad, [[0.0], [-math.exp(-12.0) / 2]], rtol=1e-5)


def test_sapo_by_hand_ignores_loss_agg_mode():
    """On policy the gate is sigmoid(0)·4/tau = 2/tau and its slope makes the gradient -A (as PPO's)."""
    old = lp = f32([-1.0, -2.0], [-0.5, -0.5])
    adv = f32([1.0, -1.0], [2.0, 0.0])
    mask = f32([1, 1], [1, 0])
    cfg = PolicyLossConfig(tau_pos=1.0, tau_neg=1.05, loss_agg_mode="token-sum")
    loss, m, grad = _run(compute_policy_loss_sapo, old, lp, adv, mask, config=cfg)
    np.testing.assert_allclose(loss, ((-2 + 2 / 1.05) / 2 + -4) / 2, rtol=1e-6)  # seq-mean-token-mean
    np.testing.assert_allclose(grad, [[-1 / 4, 1 / 4], [-2 / 2, 0]], rtol=1e-6)
    assert m == {"pg_clipfrac": 0.0, "ppo_kl": 0.0, "pg_clipfrac_lower": 0.0}


def test_gpg_by_hand():
    loss, m, grad = _run(compute_policy_loss_gpg, np.zeros((1, 2), np.float32), f32([-1.0, -2.0]), f32([1.0, 0.5]),
                         config=PolicyLossConfig())
    np.testing.assert_allclose(loss, (1 + 1) / 2)
    np.testing.assert_allclose(grad, [[-0.5, -0.25]])
    assert m == {}


def test_geo_mean_by_hand():
    """Row 1 (A = 1): d = (0.1, 0.5) clips to (0.1, 0.28); the clipped token has no gradient.
    Row 2 (A = -1): d = 0.5 is above the range but on the pessimistic side, so it is kept.
    Row 3 is empty: it adds nothing and is not counted."""
    old = np.zeros((3, 2), np.float32)
    lp = f32([0.1, 0.5], [0.5, 0.0], [0.0, 0.0])
    adv = f32([1.0, 1.0], [-1.0, 0.0], [0.0, 0.0])
    mask = f32([1, 1], [1, 0], [0, 0])
    loss, m, grad = _run(compute_policy_loss_geo_mean, old, lp, adv, mask,
                         config=PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-sum"))
    r1, r2 = math.exp((0.1 + 0.28) / 2), math.exp(0.5)
    np.testing.assert_allclose(loss, (-r1 + r2) / 2, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-r1 / 2 / 2, 0], [r2 / 2, 0], [0, 0]], rtol=1e-6)
    np.testing.assert_allclose([m["pg_clipfrac"], m["pg_clipfrac_lower"]], [1 / 3, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(m["ppo_kl"], -(0.1 + 0.5 + 0.5) / 3, rtol=1e-6)


def test_geo_mean_weights_enter_as_sequence_geometric_mean():
    old = lp = np.zeros((1, 2), np.float32)
    w = f32([4.0, 1.0])
    fn = functools.partial(compute_policy_loss_geo_mean, config=PolicyLossConfig(), rollout_is_weights=w)
    loss, _, _ = _run(fn, old, lp, f32([1.0, 1.0]))
    np.testing.assert_allclose(loss, -2.0, rtol=1e-6)  # -A·ratio·sqrt(4·1)


def test_cispo_by_hand_keeps_every_gradient():
    """Ratios (1.5, 0.5, 1.0) clip to (1.28, 0.8, 1.0); the gradient is -sg(clip(r))·A / N everywhere."""
    lp = f32([-1.0, -2.0, -0.5])
    old = lp - np.log(f32([1.5, 0.5, 1.0]))
    adv = f32([1.0, -1.0, 2.0])
    loss, m, grad = _run(compute_policy_loss_cispo, old, lp, adv, config=PolicyLossConfig(clip_ratio_high=0.28))
    np.testing.assert_allclose(loss, (1.28 - 1.6 + 1.0) / 3, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.28 / 3, 0.8 / 3, -2.0 / 3]], rtol=1e-5)
    np.testing.assert_allclose([m["pg_clipfrac"], m["pg_clipfrac_lower"]], [2 / 3, 0.0], rtol=1e-6)


# (p_old, p, A) per token: TV and binary-KL trust regions disagree on the second token only.
_DPPO_TOKENS = [(0.5, 0.9, 1.0), (0.35, 0.65, 1.0), (0.5, 0.2, -1.0), (0.5, 0.4, -1.0), (0.5, 0.05, 1.0)]


@pytest.mark.parametrize("fn, valid", [(compute_policy_loss_dppo_tv, [0, 0, 0, 1, 1]),
                                       (compute_policy_loss_dppo_kl, [0, 1, 0, 1, 1])])
def test_dppo_by_hand(fn, valid):
    """TV: |p - p_old| = 0.4, 0.3, 0.3 leave the region (0.28 up, 0.2 down); the last token moves the
    wrong way. KL: the second token's binary KL is 0.3·log(0.65/0.35) = 0.186 <= 0.28, so it stays, with
    its ratio 1.86 truncated to c = 1.5."""
    old, lp, adv = (f32([math.log(t[0]) for t in _DPPO_TOKENS]), f32([math.log(t[1]) for t in _DPPO_TOKENS]),
                    f32([t[2] for t in _DPPO_TOKENS]))
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.5)
    loss, m, grad = _run(fn, old, lp, adv, config=cfg)
    truncated = [min(p / po, 1.5) for po, p, _ in _DPPO_TOKENS]
    want_grad = [-a * tr * v / 5 for (_, _, a), tr, v in zip(_DPPO_TOKENS, truncated, valid)]
    want_loss = sum(g * math.log(p) for g, (_, p, _) in zip(want_grad, _DPPO_TOKENS))
    np.testing.assert_allclose(grad[0], want_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(m["pg_clipfrac"], 1 - sum(valid) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac_lower"], valid[1] / 5, rtol=1e-6)  # only token 2 has r > c and valid


def test_dro_by_hand():
    old, lp, adv = f32([-1.5, -1.0]), f32([-1.0, -2.0]), f32([1.0, -1.0])
    loss, m, grad = _run(compute_policy_loss_dro, old, lp, adv, config=PolicyLossConfig(dro_beta=0.5))
    # d = (0.5, -1): loss = -(lp·A - 0.25·d²) = (1.0625, -1.75); gradient (-A + 0.5·d) / 2.
    np.testing.assert_allclose(loss, (1.0625 - 1.75) / 2, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-0.375, 0.25]], rtol=1e-6)
    assert m == {"ppo_kl": 0.25}


@pytest.mark.parametrize("beta", [None, 0.0])
def test_dro_needs_a_positive_beta(beta):
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="dro_beta"):
        compute_policy_loss_dro(x, x, x, x, config=PolicyLossConfig(dro_beta=beta))


# ---- clip_cov / kl_cov selection -------------------------------------------------------------------------

# Ten valid tokens (two rows of five), mean A = 0 and mean log_prob = -3 exactly, so the covariance
# is A·e with e = log_prob + 3: (2, 2, 2, -1, 0, 1, -2, -3, 1.5, 0) for CLIP_E.
CLIP_A = f32([2.0, -2.0, 1.0, -1.0, 0.0], [2.0, -2.0, 1.0, -1.0, 0.0])
CLIP_LP = f32([-2.0, -4.0, -1.0, -2.0, -3.0], [-2.5, -2.0, -6.0, -4.5, -3.0])


def _clip_cov_inputs():
    old = CLIP_LP.copy()
    old[0, 1] += 1.0  # ratio e^-1 with A = -2: PPO already clips token 1, so it is no candidate
    return old, CLIP_LP, CLIP_A, np.ones_like(CLIP_A)


def test_clip_cov_selects_k_candidates_inside_the_window():
    """Covariances 2, 2, 2, -1, 0, 1, -2, -3, 1.5, 0: inside (1, 5) are tokens 0, 1, 2 and 8 (1 is not,
    strictly); token 1 is clipped by PPO. So the candidates are {0, 2, 8}, and k = int(0.2·10) = 2."""
    cfg = PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=1.0, clip_cov_ub=5.0)
    select = jax.jit(select_cov_tokens, static_argnums=4)
    seen = set()
    for seed in range(12):
        s = np.asarray(select(*_clip_cov_inputs(), cfg, jax.random.key(seed)))
        chex.assert_shape(s, (2, 5))
        assert s.dtype == np.float32 and set(np.unique(s)) <= {0.0, 1.0}
        chosen = set(np.flatnonzero(s.reshape(-1)))
        assert len(chosen) == 2 and chosen <= {0, 2, 8}, chosen
        seen |= chosen
    assert seen == {0, 2, 8}  # a random subset, not always the same one
    for ratio, count in [(0.5, 3), (0.01, 1)]:  # k = 5 > 3 candidates: all of them; k = max(1, 0) = 1
        s = select(*_clip_cov_inputs(), PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=ratio),
                   jax.random.key(0))
        assert int(s.sum()) == count


def test_clip_cov_loss_drops_the_selected_gradients():
    old, lp, adv, mask = _clip_cov_inputs()
    select = np.zeros_like(adv)
    select[0, 0] = select[1, 3] = 1.0
    loss, m, grad = _run(compute_policy_loss_clip_cov, old, lp, adv, mask, token_select=select,
                         config=PolicyLossConfig(loss_mode="clip_cov"))
    want_grad = -adv / 10  # on policy (ratio 1), except the PPO-clipped token 1 and the selected ones
    want_grad[0, 1] = want_grad[0, 0] = want_grad[1, 3] = 0.0
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-7)
    want_loss = (-adv).copy()
    want_loss[0, 1] = 2.0 * 0.8  # -A·clip(e^-1) with A = -2
    want_loss[0, 0] = want_loss[1, 3] = 0.0
    np.testing.assert_allclose(loss, want_loss.mean(), rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac"], 2 / 10)


def test_kl_cov_selects_the_top_k_and_penalises_them():
    """Covariances (3, 1, 2.5, -1, 0, 1, -2, -3, 2, 0): k = int(0.3·10) = 3 picks tokens 0, 2 and 8. With
    d = -0.1 everywhere, each adds 0.5·|d| = 0.05 to its token's loss and 0.5·sign(d) = -0.5 to its gradient."""
    adv, lp = CLIP_A, f32([-1.5, -3.5, -0.5, -2.0, -3.0], [-2.5, -2.0, -6.0, -5.0, -4.0])
    old = lp + 0.1
    cfg = PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.3, ppo_kl_coef=0.5)
    s = np.asarray(jax.jit(select_cov_tokens, static_argnums=4)(old, lp, adv, np.ones_like(adv), cfg, None))
    np.testing.assert_array_equal(np.flatnonzero(s.reshape(-1)), [0, 2, 8])
    loss, m, grad = _run(compute_policy_loss_kl_cov, old, lp, adv, config=cfg)  # selects on its own
    r = math.exp(-0.1)
    np.testing.assert_allclose(loss, 3 * 0.5 * 0.1 / 10, rtol=1e-5, atol=1e-7)  # sum(-A·r) = 0
    np.testing.assert_allclose(grad, (-adv * r - 0.5 * s) / 10, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["ppo_kl"], 0.1, rtol=1e-5)  # kl_cov reports mean |d|


@pytest.mark.parametrize("ratio", [0.0002, 0.29, 0.07, 0.3, 1 / 3, 0.5])
def test_selection_count_is_verls_float64_formula(ratio):
    """k = max(1, int(ratio · N)) over N = 0 .. 200 valid tokens (none for N = 0), the product in float64:
    int(0.29 · 100) = 28 in Python, where float32 would give 29."""
    t = 200
    lp = -jnp.linspace(0.1, 5.0, t, dtype=jnp.float32)[None]
    adv = jnp.linspace(-1.0, 1.0, t, dtype=jnp.float32)[None]
    masks = (jnp.arange(t)[None] < jnp.arange(t + 1)[:, None]).astype(jnp.float32)[:, None]  # [N + 1, 1, T]
    want = [0] + [max(1, int(ratio * n)) for n in range(1, t + 1)]
    for cfg in (PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=ratio),
                # A window holding every token, on policy: the candidates are all valid tokens.
                PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=ratio, clip_cov_lb=-1e9, clip_cov_ub=1e9)):
        select = jax.vmap(lambda m, cfg=cfg: select_cov_tokens(lp, lp, adv, m, cfg, jax.random.key(1)))
        got = np.asarray(jax.jit(select)(masks).sum(axis=(1, 2)))
        np.testing.assert_array_equal(got, want, err_msg=cfg.loss_mode)
    if ratio == 0.0002:  # the float32 trap at veRL's default: int(0.0002 · 10000) = 2
        mask = jnp.ones((1, 10000), jnp.float32)
        x = -jnp.linspace(0.1, 5.0, 10000, dtype=jnp.float32)[None]
        s = select_cov_tokens(x, x, -x, mask, PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=ratio), None)
        assert int(s.sum()) == 2


def test_select_cov_tokens_rejects_other_losses():
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="clip_cov"):
        select_cov_tokens(x, x, x, x, PolicyLossConfig(loss_mode="vanilla"), jax.random.key(0))


# ---- numpy references on random batches ------------------------------------------------------------------

REFERENCE_CASES = [(name, mode) for name in LOSS_NAMES if name != "vanilla"
                   for mode in (("token-mean",) if name in MODE_FREE_LOSSES else LOSS_AGG_MODES)]


class ReferenceTest(chex.TestCase):
    """Loss, metrics and gradient against the float64 references, on batches with empty rows and a row
    of one token, with and without rollout-correction weights."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*REFERENCE_CASES)
    def test_against_numpy_reference(self, name, mode):
        cfg = config_for(name, mode)
        for seed, weighted in [(0, False), (1, True)]:
            b = pg_batch(seed)
            args = [b[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask")]
            w = b["rollout_is_weights"] if weighted else None
            select, ref_kw = None, {}
            if name == "clip_cov":
                select = np.asarray(select_cov_tokens(*args, cfg, jax.random.key(seed)))
                candidates, k = ref_pg.clip_cov_candidates(*args, cfg)
                assert np.all(candidates[select > 0]) and select.sum() == min(k, candidates.sum()) >= 2
                ref_kw["select"] = select
            elif name == "kl_cov":
                ref_kw["select"] = ref_pg.kl_cov_select(args[1], args[2], args[3], cfg)
                np.testing.assert_array_equal(select_cov_tokens(*args, cfg, None), ref_kw["select"])

            def f(lp, args=args, select=select, w=w):
                return get_policy_loss_fn(name)(args[0], lp, *args[2:], config=cfg, rollout_is_weights=w,
                                                token_select=select)

            (loss, metrics), grad = self.variant(jax.value_and_grad(f, has_aux=True))(args[1])
            want = getattr(ref_pg, name)(*args, cfg, w, **ref_kw)
            chex.assert_trees_all_close((loss, metrics, grad), want, rtol=1e-5, atol=1e-6,
                                        custom_message=f"{name} {mode} seed {seed}")


@pytest.mark.parametrize("name", ["sapo", "gpg", "geo_mean", "dro", "clip_cov", "kl_cov"])
def test_reference_gradients_match_finite_differences(name):
    """The hand-derived reference gradients of the losses without stop-gradients (the cov losses with a
    fixed selection) agree with central differences of the reference loss."""
    b = pg_batch(2)
    args = [np.asarray(b[k], np.float64) for k in ("old_log_prob", "log_prob", "advantages", "response_mask")]
    cfg = config_for(name, "seq-mean-token-mean")
    kw = {"select": (np.arange(args[1].size).reshape(args[1].shape) % 3 == 0) * 1.0} if "cov" in name else {}
    fn = getattr(ref_pg, name)
    _, _, grad = fn(*args, cfg, b["rollout_is_weights"], **kw)
    eps, fd = 1e-6, np.zeros_like(grad)
    for i, t in np.ndindex(grad.shape):
        up, down = args[1].copy(), args[1].copy()
        up[i, t] += eps
        down[i, t] -= eps
        fd[i, t] = (fn(args[0], up, *args[2:], cfg, b["rollout_is_weights"], **kw)[0]
                    - fn(args[0], down, *args[2:], cfg, b["rollout_is_weights"], **kw)[0]) / (2 * eps)
    np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-6)
    assert np.abs(grad).sum() > 0
