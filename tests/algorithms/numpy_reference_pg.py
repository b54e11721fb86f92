"""Float64 numpy references for the policy losses, token by token, transcribed from veRL 0.9.1's semantics.

Each `<name>(old_lp, lp, adv, mask, cfg, w=None, ...)` returns `(loss, metrics, grad)`: the loss, the
metrics dict (veRL's keys without "actor/"), and d loss / d lp [B, T], derived by hand per token
(with veRL's stop-gradients and clamps) and multiplied by the aggregation weights. `cfg` is read for
its hyperparameters only. `w` are rollout-correction weights (None: all ones).
"""

from __future__ import annotations

import math

import numpy as np

from tests.algorithms.numpy_reference import agg_loss, masked_mean


def agg_weights(mask, mode):
    """d agg_loss / d loss_mat: every mode is linear in the per-token loss. [B, T] float64."""
    mask = np.asarray(mask, np.float64)
    out = np.zeros_like(mask)
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    num_seqs = max(len(rows), 1)
    for i in rows:
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                continue
            if mode == "token-mean":
                out[i, t] = 1.0 / mask.sum()
            elif mode == "token-sum":
                out[i, t] = 1.0
            elif mode == "seq-mean-token-sum":
                out[i, t] = 1.0 / num_seqs
            elif mode == "seq-mean-token-mean":
                out[i, t] = 1.0 / (mask[i].sum() * num_seqs)
            elif mode == "seq-mean-token-sum-norm":
                out[i, t] = 1.0 / (num_seqs * mask.shape[1])
            else:
                raise ValueError(mode)
    return out


def _prep(old_lp, lp, adv, mask, w):
    old_lp, lp, adv, mask = (np.asarray(x, np.float64) for x in (old_lp, lp, adv, mask))
    w = np.ones_like(lp) if w is None else np.asarray(w, np.float64)
    return old_lp, lp, adv, mask, w


def _finish(losses, dlosses, mask, w, mode, metrics):
    """Aggregate per-token losses and their derivatives (both [B, T]) times the weights w."""
    return agg_loss(losses * w, mask, mode), metrics, agg_weights(mask, mode) * dlosses * w


def _clamp(x, lo, hi):
    return min(max(x, lo), hi)


def _ppo_token(a, r, dr, low, high):
    """PPO's clipped term max(-a·r, -a·clip(r)) and its derivative (dr = d r / d lp)."""
    l1, l2 = -a * r, -a * _clamp(r, 1 - low, 1 + high)
    return (l2, 0.0, True) if l2 > l1 else (l1, -a * dr, False)


def vanilla(old_lp, lp, adv, mask, cfg, w=None):
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    out, dout, clipped, lower = (np.zeros_like(lp) for _ in range(4))
    for i, t in np.ndindex(lp.shape):
        d = lp[i, t] - old_lp[i, t]
        r = math.exp(_clamp(d, -20, 20))
        dr = r if abs(d) < 20 else 0.0
        a = adv[i, t]
        out[i, t], dout[i, t], clipped[i, t] = _ppo_token(a, r, dr, cfg.clip_ratio_low, cfg.clip_ratio_high)
        if a < 0 and out[i, t] > -a * cfg.clip_ratio_c:
            out[i, t], dout[i, t], lower[i, t] = -a * cfg.clip_ratio_c, 0.0, 1.0
    metrics = {"pg_clipfrac": masked_mean(clipped, mask), "pg_clipfrac_lower": masked_mean(lower, mask),
               "ppo_kl": masked_mean(-np.clip(lp - old_lp, -20, 20), mask)}
    return _finish(out, dout, mask, w, cfg.loss_agg_mode, metrics)


def gspo(old_lp, lp, adv, mask, cfg, w=None):
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    out, dout, clipped = (np.zeros_like(lp) for _ in range(3))
    for i in range(lp.shape[0]):
        n = max(mask[i].sum(), 1.0)
        log_s = sum((lp[i, t] - old_lp[i, t]) * mask[i, t] for t in range(lp.shape[1])) / n
        s = math.exp(min(log_s, 10.0))
        ds = s if log_s < 10.0 else 0.0  # d s_it / d lp_it: the value is detached, the gradient is lp_it's
        for t in range(lp.shape[1]):
            out[i, t], dout[i, t], clipped[i, t] = _ppo_token(adv[i, t], s, ds, cfg.clip_ratio_low,
                                                              cfg.clip_ratio_high)
    metrics = {"pg_clipfrac": masked_mean(clipped, mask), "ppo_kl": masked_mean(old_lp - lp, mask),
               "pg_clipfrac_lower": 0.0}
    return _finish(out, dout, mask, w, cfg.loss_agg_mode, metrics)


def sapo(old_lp, lp, adv, mask, cfg, w=None):
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    out, dout = np.zeros_like(lp), np.zeros_like(lp)
    for i, t in np.ndindex(lp.shape):
        d = lp[i, t] - old_lp[i, t]
        r = math.exp(_clamp(d, -20, 20))
        dr = r if abs(d) < 20 else 0.0
        a = adv[i, t]
        tau = cfg.tau_pos if a > 0 else cfg.tau_neg
        sig = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
        out[i, t] = -a * sig * 4.0 / tau
        dout[i, t] = -a * 4.0 * sig * (1.0 - sig) * dr
    metrics = {"pg_clipfrac": 0.0, "ppo_kl": masked_mean(-np.clip(lp - old_lp, -20, 20), mask),
               "pg_clipfrac_lower": 0.0}
    return _finish(out, dout, mask, w, "seq-mean-token-mean", metrics)


def gpg(old_lp, lp, adv, mask, cfg, w=None):
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    return _finish(-lp * adv, -adv, mask, w, cfg.loss_agg_mode, {})


def geo_mean(old_lp, lp, adv, mask, cfg, w=None):
    """Mean over the non-empty rows (veRL: over all rows; the deviation is documented in our loss)."""
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    rows = [i for i in range(lp.shape[0]) if mask[i].sum() > 0]
    loss, grad = 0.0, np.zeros_like(lp)
    clip_hi, clip_lo = np.zeros_like(lp), np.zeros_like(lp)
    for i in rows:
        tokens = [t for t in range(lp.shape[1]) if mask[i, t] > 0]
        n = len(tokens)
        log_ratio, dlog_ratio = 0.0, {}
        for t in tokens:
            d, a = lp[i, t] - old_lp[i, t], adv[i, t]
            dc = _clamp(d, -cfg.clip_ratio_low, cfg.clip_ratio_high)
            sgn = float(np.sign(a))
            log_ratio += sgn * min(sgn * d, sgn * dc)
            # The raw d is kept (gradient 1) when it is on the pessimistic side of its clipped value.
            dlog_ratio[t] = 1.0 if sgn != 0 and sgn * d <= sgn * dc else 0.0
            clip_hi[i, t] = float(d != dc and a > 0)
            clip_lo[i, t] = float(d != dc and a < 0)
        ratio = math.exp(log_ratio / n)
        seq_adv = sum(adv[i, t] for t in tokens) / n
        seq_w = math.exp(sum(math.log(w[i, t] + 1e-10) for t in tokens) / n)
        loss += -seq_adv * ratio * seq_w / len(rows)
        for t in tokens:
            grad[i, t] = -seq_adv * ratio * seq_w * dlog_ratio[t] / n / len(rows)
    metrics = {"pg_clipfrac": masked_mean(clip_hi, mask), "ppo_kl": masked_mean(old_lp - lp, mask),
               "pg_clipfrac_lower": masked_mean(clip_lo, mask)}
    return loss, metrics, grad


def cispo(old_lp, lp, adv, mask, cfg, w=None):
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    out, dout, clipped = (np.zeros_like(lp) for _ in range(3))
    for i, t in np.ndindex(lp.shape):
        r = math.exp(_clamp(lp[i, t] - old_lp[i, t], -20, 20))
        rc = _clamp(r, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
        out[i, t] = -rc * adv[i, t] * lp[i, t]
        dout[i, t] = -rc * adv[i, t]  # the clipped ratio is detached
        clipped[i, t] = float(r != rc)
    metrics = {"pg_clipfrac": masked_mean(clipped, mask), "ppo_kl": masked_mean(-np.clip(lp - old_lp, -20, 20), mask),
               "pg_clipfrac_lower": 0.0}
    return _finish(out, dout, mask, w, cfg.loss_agg_mode, metrics)


def _dppo(old_lp, lp, adv, mask, cfg, w, binary_kl):
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    out, dout, invalid, truncated = (np.zeros_like(lp) for _ in range(4))
    for i, t in np.ndindex(lp.shape):
        r = math.exp(_clamp(lp[i, t] - old_lp[i, t], -20, 20))
        tr = min(r, cfg.clip_ratio_c)
        p, po = math.exp(lp[i, t]), math.exp(old_lp[i, t])
        if binary_kl:
            kl = po * (old_lp[i, t] - lp[i, t]) + (1 - po) * math.log((1 - po + 1e-8) / (1 - p + 1e-8))
            ok = (kl <= cfg.clip_ratio_high or p <= po) if adv[i, t] > 0 else (kl <= cfg.clip_ratio_low or p >= po)
        else:
            ok = p - po <= cfg.clip_ratio_high if adv[i, t] > 0 else p - po >= -cfg.clip_ratio_low
        out[i, t] = -adv[i, t] * tr * lp[i, t] * ok
        dout[i, t] = -adv[i, t] * tr * ok
        invalid[i, t] = float(not ok)
        truncated[i, t] = float(r > cfg.clip_ratio_c and ok)
    metrics = {"pg_clipfrac": masked_mean(invalid, mask), "ppo_kl": masked_mean(-np.clip(lp - old_lp, -20, 20), mask),
               "pg_clipfrac_lower": masked_mean(truncated, mask)}
    return _finish(out, dout, mask, w, cfg.loss_agg_mode, metrics)


def dppo_tv(old_lp, lp, adv, mask, cfg, w=None):
    return _dppo(old_lp, lp, adv, mask, cfg, w, binary_kl=False)


def dppo_kl(old_lp, lp, adv, mask, cfg, w=None):
    return _dppo(old_lp, lp, adv, mask, cfg, w, binary_kl=True)


def dro(old_lp, lp, adv, mask, cfg, w=None):
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    d = lp - old_lp
    out = -(lp * adv - 0.5 * cfg.dro_beta * d**2)
    return _finish(out, -adv + cfg.dro_beta * d, mask, w, cfg.loss_agg_mode, {"ppo_kl": masked_mean(-d, mask)})


def _covariance(lp, adv, mask):
    valid = [(i, t) for i, t in np.ndindex(lp.shape) if mask[i, t] > 0]
    mean_a = np.mean([adv[i, t] for i, t in valid]) if valid else 0.0
    mean_lp = np.mean([lp[i, t] for i, t in valid]) if valid else 0.0
    return {(i, t): (adv[i, t] - mean_a) * (lp[i, t] - mean_lp) for i, t in valid}


def clip_cov_candidates(old_lp, lp, adv, mask, cfg):
    """veRL's clip_cov candidates (a bool [B, T]) and its count k = max(int(ratio · N), 1)."""
    old_lp, lp, adv, mask, _ = _prep(old_lp, lp, adv, mask, None)
    cand = np.zeros(lp.shape, bool)
    for (i, t), c in _covariance(lp, adv, mask).items():
        r = math.exp(lp[i, t] - old_lp[i, t])
        clipped = -adv[i, t] * _clamp(r, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high) > -adv[i, t] * r
        cand[i, t] = not clipped and cfg.clip_cov_lb < c < cfg.clip_cov_ub
    return cand, max(int(cfg.clip_cov_ratio * int(mask.sum())), 1)


def kl_cov_select(lp, adv, mask, cfg):
    """veRL's kl_cov top-k (k = max(1, int(N · ratio))) of the covariance over the valid tokens."""
    lp, adv, mask = (np.asarray(x, np.float64) for x in (lp, adv, mask))
    cov = _covariance(lp, adv, mask)
    select = np.zeros(lp.shape)
    if cov:
        k = max(1, int(len(cov) * cfg.kl_cov_ratio))
        for i, t in sorted(cov, key=lambda it: -cov[it])[:k]:
            select[i, t] = 1.0
    return select


def clip_cov(old_lp, lp, adv, mask, cfg, w=None, select=None):
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    out, dout = np.zeros_like(lp), np.zeros_like(lp)
    for i, t in np.ndindex(lp.shape):
        r = math.exp(lp[i, t] - old_lp[i, t])
        out[i, t], dout[i, t], _ = _ppo_token(adv[i, t], r, r, cfg.clip_ratio_low, cfg.clip_ratio_high)
    keep = 1.0 - select
    metrics = {"pg_clipfrac": masked_mean(select, mask), "ppo_kl": masked_mean(old_lp - lp, mask)}
    return _finish(out * keep, dout * keep, mask, w, cfg.loss_agg_mode, metrics)


def kl_cov(old_lp, lp, adv, mask, cfg, w=None, select=None):
    old_lp, lp, adv, mask, w = _prep(old_lp, lp, adv, mask, w)
    d = lp - old_lp
    r = np.exp(d)
    out = -adv * r + select * cfg.ppo_kl_coef * np.abs(d)
    dout = -adv * r + select * cfg.ppo_kl_coef * np.sign(d)
    return _finish(out, dout, mask, w, cfg.loss_agg_mode, {"ppo_kl": masked_mean(np.abs(d), mask)})
