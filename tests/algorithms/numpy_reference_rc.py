"""Float64 numpy reference for rollout correction, written row by row from veRL's formulas.

It re-derives the thresholds from the config strings, then walks the batch one sequence and one token
at a time (lists of the valid tokens, no masked vector ops), so a vectorisation or masking mistake in
`jaxrl_llm.algorithms.rollout_correction` cannot be mirrored here. One convention differs from veRL
on purpose (as in the code under test): rows with no valid token are left out of every sequence
statistic.
"""

from __future__ import annotations

import math

import numpy as np

BOUND = 20.0


def _clip(x):
    return min(max(x, -BOUND), BOUND)


def parse(config):
    """(is_upper, is_lower | None, [(mode, lower | None, upper)]) from the config's strings."""
    spec = config.rollout_is_threshold
    if isinstance(spec, str) and "_" in spec:
        lo, hi = spec.split("_")
        is_upper, is_lower = float(hi), float(lo)
    else:
        is_upper, is_lower = float(spec), None
    modes = []
    if config.rollout_rs is not None:
        names = []
        for name in config.rollout_rs.split(","):
            if name.strip() and name.strip() not in names:
                names.append(name.strip())
        specs = str(config.rollout_rs_threshold).split(",")
        specs = specs * len(names) if len(specs) == 1 else specs
        for name, s in zip(names, specs):
            s = s.strip()
            if name.endswith("k1"):
                if "_" in s:
                    lo, hi = s.split("_")
                    modes.append((name, float(lo), float(hi)))
                else:
                    modes.append((name, 1.0 / float(s), float(s)))
            else:
                modes.append((name, None, float(s)))
    return is_upper, is_lower, modes


class _Batch:
    """The valid tokens of each non-empty row, as float64 python lists."""

    def __init__(self, mask):
        self.b, self.t = mask.shape
        self.rows = [i for i in range(self.b) if mask[i].sum() > 0]
        self.tokens = {i: [t for t in range(self.t) if mask[i, t] != 0] for i in range(self.b)}
        self.n_tok = sum(len(self.tokens[i]) for i in self.rows)

    def token_values(self, per_token):
        return [per_token[i][t] for i in self.rows for t in self.tokens[i]]

    def token_mean(self, per_token):
        return sum(self.token_values(per_token)) / self.n_tok

    def seq_mean(self, per_row):
        return sum(per_row[i] for i in self.rows) / len(self.rows)

    def seq_std(self, per_row):
        vals = [per_row[i] for i in self.rows]
        return float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0

    def seq_vals(self, per_row):
        return [per_row[i] for i in self.rows]

    def token_std(self, per_token):
        vals = self.token_values(per_token)
        if len(vals) <= 1:
            return 0.0
        mean = sum(vals) / len(vals)
        return math.sqrt(max(sum(v * v for v in vals) / len(vals) - mean * mean, 0.0))

    def row_sum(self, i, per_token):
        return sum(per_token[i][t] for t in self.tokens[i])

    def row_mean(self, i, per_token):
        return self.row_sum(i, per_token) / len(self.tokens[i]) if self.tokens[i] else 0.0


def _frac(flags):
    return sum(1.0 for f in flags if f) / len(flags)


def offpolicy_metrics(log_prob, rollout_log_prob, mask):
    lp, rlp = np.asarray(log_prob, np.float64), np.asarray(rollout_log_prob, np.float64)
    bt = _Batch(mask)
    lr = lp - rlp
    mean_lp = {i: bt.row_mean(i, lp) for i in bt.rows}
    mean_rlp = {i: bt.row_mean(i, rlp) for i in bt.rows}
    diff = {i: mean_rlp[i] - mean_lp[i] for i in bt.rows}
    rho2 = [[math.exp(_clip(lr[i, t])) ** 2 for t in range(bt.t)] for i in range(bt.b)]
    return {
        "training_ppl": bt.seq_mean({i: math.exp(-mean_lp[i]) for i in bt.rows}),
        "training_log_ppl": bt.seq_mean({i: -mean_lp[i] for i in bt.rows}),
        "kl": bt.token_mean(rlp - lp),
        "k3_kl": bt.token_mean(np.exp(lr) - lr - 1.0),
        "rollout_ppl": bt.seq_mean({i: math.exp(-mean_rlp[i]) for i in bt.rows}),
        "rollout_log_ppl": bt.seq_mean({i: -mean_rlp[i] for i in bt.rows}),
        "log_ppl_diff": bt.seq_mean(diff),
        "log_ppl_abs_diff": bt.seq_mean({i: abs(d) for i, d in diff.items()}),
        "log_ppl_diff_max": max(diff.values()),
        "log_ppl_diff_min": min(diff.values()),
        "ppl_ratio": bt.seq_mean({i: math.exp(d) for i, d in diff.items()}),
        "chi2_token": bt.token_mean(rho2) - 1.0,
        "chi2_seq": bt.seq_mean({i: math.exp(_clip(bt.row_sum(i, lr))) ** 2 for i in bt.rows}) - 1.0,
    }


def _is(lr, bt, level, upper, lower_icepop, batch_normalize):
    icepop = lower_icepop is not None
    lower = lower_icepop if icepop else 1.0 / upper
    raw = np.zeros((bt.b, bt.t))
    seq_lr = {}
    for i in bt.rows:
        seq_lr[i] = bt.row_sum(i, lr)
        for t in bt.tokens[i]:
            raw[i, t] = math.exp(_clip(lr[i, t] if level == "token" else seq_lr[i]))
    w = np.zeros_like(raw)
    for i in bt.rows:
        for t in bt.tokens[i]:
            if icepop:
                w[i, t] = raw[i, t] if lower <= raw[i, t] <= upper else 0.0
            else:
                w[i, t] = min(raw[i, t], upper)
    m = {"rollout_is_mean": bt.token_mean(w)}
    if level == "sequence":
        m["rollout_is_max"] = math.exp(min(max(bt.seq_vals(seq_lr)), BOUND))
        m["rollout_is_min"] = math.exp(min(bt.seq_vals(seq_lr)))
        m["rollout_is_ratio_fraction_high"] = _frac([s > math.log(upper) for s in bt.seq_vals(seq_lr)])
        m["rollout_is_ratio_fraction_low"] = _frac([s < math.log(lower) for s in bt.seq_vals(seq_lr)])
    else:
        m["rollout_is_max"] = max(bt.token_values(w))
        m["rollout_is_min"] = min(bt.token_values(w))
        m["rollout_is_ratio_fraction_high"] = _frac([r > upper for r in bt.token_values(raw)])
        m["rollout_is_ratio_fraction_low"] = _frac([r < lower for r in bt.token_values(raw)])
    clamped = np.clip(w, 0.0, upper)
    m["rollout_is_std"] = bt.token_std(clamped)
    mean_c = bt.token_mean(clamped)
    m["rollout_is_eff_sample_size"] = 1.0 / bt.token_mean((clamped / (mean_c + 1e-8)) ** 2)
    seq_w = {i: bt.row_mean(i, w) for i in bt.rows}
    raw_seq_w = {i: bt.row_mean(i, raw) for i in bt.rows}
    m["rollout_is_seq_mean"] = bt.seq_mean(seq_w)
    m["rollout_is_seq_std"] = bt.seq_std(seq_w)
    m["rollout_is_seq_max"] = max(seq_w.values())
    m["rollout_is_seq_min"] = min(seq_w.values())
    m["rollout_is_seq_max_deviation"] = max(abs(v - 1.0) for v in seq_w.values())
    m["rollout_is_seq_fraction_high"] = _frac([v > upper for v in raw_seq_w.values()])
    m["rollout_is_seq_fraction_low"] = _frac([v < lower for v in raw_seq_w.values()])
    if icepop:
        m["rollout_is_oob_ratio"] = _frac([not (lower <= r <= upper) for r in bt.token_values(raw)])
    if batch_normalize:
        mean = bt.token_mean(w) if level == "token" else bt.seq_mean(seq_w)
        if mean > 1e-8:
            w = w / mean
        m["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    return w, m


def _divergence(kind, x):
    x = _clip(x)
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1.0 - x}[kind]


def _rs(lr, bt, modes):
    keep_all = np.ones((bt.b, bt.t), bool)
    m = {}
    for name, lower, upper in modes:
        level, kind = name.rsplit("_", 1)
        k1 = kind == "k1"
        hi = math.log(upper) if k1 else upper
        lo = math.log(lower) if k1 else 0.0
        ok = (lambda s, lo=lo, hi=hi: lo <= s <= hi) if k1 else (lambda s, hi=hi: s <= hi)
        div = np.zeros((bt.b, bt.t))
        for i in bt.rows:
            for t in bt.tokens[i]:
                div[i, t] = _divergence(kind, lr[i, t])
        stat = np.zeros((bt.b, bt.t))
        keep = np.ones((bt.b, bt.t), bool)
        seq = {}
        for i in bt.rows:
            vals = [div[i, t] for t in bt.tokens[i]]
            if level == "token":
                seq[i] = sum(vals) / len(vals)
                for t in bt.tokens[i]:
                    stat[i, t], keep[i, t] = div[i, t], ok(div[i, t])
            else:
                seq[i] = {"seq_sum": sum(vals), "seq_mean": sum(vals) / len(vals), "seq_max": max(vals)}[level]
                stat[i, :], keep[i, :] = seq[i], ok(seq[i])
        p = f"rollout_rs_{name}"
        m[f"{p}_mean"] = bt.token_mean(stat)
        judged = bt.token_values(stat) if level == "token" else bt.seq_vals(seq)
        m[f"{p}_max"], m[f"{p}_min"] = max(judged), min(judged)
        m[f"{p}_fraction_high"] = _frac([s > hi for s in judged])
        m[f"{p}_fraction_low"] = _frac([s < lo for s in judged]) if k1 else 0.0
        m[f"{p}_std"] = bt.token_std(np.clip(stat, lo, hi))
        m[f"{p}_seq_mean"] = bt.seq_mean(seq)
        m[f"{p}_seq_std"] = bt.seq_std(seq)
        m[f"{p}_seq_max"] = max(seq.values())
        m[f"{p}_seq_min"] = min(seq.values())
        m[f"{p}_seq_max_deviation"] = max(abs(v) for v in seq.values())
        m[f"{p}_seq_fraction_high"] = _frac([v > hi for v in seq.values()])
        if k1:
            m[f"{p}_seq_fraction_low"] = _frac([v < lo for v in seq.values()])
        m[f"{p}_masked_fraction"] = _frac([not k for k in bt.token_values(keep)])
        m[f"{p}_seq_masked_fraction"] = _frac([not all(keep[i, t] for t in bt.tokens[i]) for i in bt.rows])
        keep_all &= keep
    m["rollout_rs_masked_fraction"] = _frac([not k for k in bt.token_values(keep_all)])
    m["rollout_rs_seq_masked_fraction"] = _frac([not all(keep_all[i, t] for t in bt.tokens[i]) for i in bt.rows])
    return keep_all, m


def rollout_correction(old_log_prob, rollout_log_prob, mask, config):
    """(weights [B, T] | None, mask [B, T], metrics with the "rollout_corr/" prefix), float64."""
    mask = np.asarray(mask)
    bt = _Batch(mask)
    lr = np.zeros(mask.shape)
    for i in bt.rows:
        for t in bt.tokens[i]:
            lr[i, t] = float(old_log_prob[i, t]) - float(rollout_log_prob[i, t])
    is_upper, is_lower, modes = parse(config)
    metrics, weights, new_mask = {}, None, mask.astype(np.float64)
    if config.rollout_is is not None:
        weights, m = _is(lr, bt, config.rollout_is, is_upper, is_lower, config.rollout_is_batch_normalize)
        metrics.update(m)
    if modes:
        keep, m = _rs(lr, bt, modes)
        metrics.update(m)
        new_mask = new_mask * keep
    metrics.update(offpolicy_metrics(old_log_prob, rollout_log_prob, mask))
    return weights, new_mask, {"rollout_corr/" + k: v for k, v in metrics.items()}


def agg_coefficients(mask, mode):
    """c [B, T] with agg_loss(L, mask, mode) = Σ c·L (every mode is linear in L; empty rows dropped)."""
    mask = np.asarray(mask, np.float64)
    lens = mask.sum(-1)
    n_seq = max((lens > 0).sum(), 1)
    if mode == "token-mean":
        return mask / max(mask.sum(), 1)
    if mode == "token-sum":
        return mask
    if mode == "seq-mean-token-sum":
        return mask / n_seq
    if mode == "seq-mean-token-sum-norm":
        return mask / n_seq / mask.shape[-1]
    return mask / np.maximum(lens, 1)[:, None] / n_seq  # seq-mean-token-mean


def reinforce(rollout_log_prob, log_prob, advantages, mask, weights, mode):
    """(loss, d loss / d log_prob, ppo_kl) of -w·A·log_prob aggregated on `mask` (w constant)."""
    lp, adv = np.asarray(log_prob, np.float64), np.asarray(advantages, np.float64)
    w = np.ones_like(lp) if weights is None else np.asarray(weights, np.float64)
    coef = agg_coefficients(mask, mode)
    per_token = -adv * w
    kl = np.asarray(rollout_log_prob, np.float64) - lp
    ppo_kl = (kl * mask).sum() / max(np.asarray(mask).sum(), 1)
    return float((coef * per_token * lp).sum()), coef * per_token, float(ppo_kl)
