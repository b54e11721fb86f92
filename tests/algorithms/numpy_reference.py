"""Float64 numpy references, loop by loop, transcribed from veRL's semantics (not from our code).

They follow veRL's torch code at the level of its loops and dict-of-groups, so a vectorisation
mistake in `jaxrl_llm.algorithms` cannot be mirrored here. Inputs are numpy arrays.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def masked_mean(x, mask, axis=None):
    x, mask = np.asarray(x, np.float64), np.asarray(mask, np.float64)
    return np.where(mask > 0, x, 0).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var(x, mask):
    mean = masked_mean(x, mask)
    var = masked_mean((np.asarray(x, np.float64) - mean) ** 2, mask)
    n = np.asarray(mask, np.float64).sum()
    assert n > 1, "veRL raises here"
    return var * n / (n - 1)


def masked_whiten(x, mask, shift_mean=True):
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (np.asarray(x, np.float64) - mean) / np.sqrt(var + 1e-8)
    return out if shift_mean else out + mean


def _groups(scores, index):
    id2score = defaultdict(list)
    for i in range(len(scores)):
        id2score[int(index[i])].append(scores[i])
    return id2score


def grpo(rewards, mask, index, eps=1e-6, norm_by_std=True):
    scores = np.asarray(rewards, np.float64).sum(-1)
    id2score = _groups(scores, index)
    out = np.zeros_like(scores)
    for i in range(len(scores)):
        group = np.array(id2score[int(index[i])])
        mean, std = (0.0, 1.0) if len(group) == 1 else (group.mean(), group.std(ddof=1))
        out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return out[:, None] * mask


def rloo(rewards, mask, index):
    scores = np.asarray(rewards, np.float64).sum(-1)
    id2score = _groups(scores, index)
    out = scores.copy()
    for i in range(len(scores)):
        group = np.array(id2score[int(index[i])])
        n = len(group)
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - group.mean() * n / (n - 1)
    return out[:, None] * mask


def reinforce_pp_baseline(rewards, mask, index):
    scores = np.asarray(rewards, np.float64).sum(-1)
    id2score = _groups(scores, index)
    out = scores.copy()
    for i in range(len(scores)):
        group = np.array(id2score[int(index[i])])
        if len(group) > 1:
            out[i] = scores[i] - group.mean()
    adv = np.tile(out[:, None], (1, mask.shape[1])) * mask
    return masked_whiten(adv, mask) * mask


def reinforce_pp(rewards, mask, gamma):
    rewards = np.asarray(rewards, np.float64)
    returns = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return masked_whiten(returns, mask) * mask, returns


def gae(rewards, values, mask, gamma, lam):
    rewards, values = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
    b, t_len = rewards.shape
    next_values, last_gae = np.zeros(b), np.zeros(b)
    adv = np.zeros_like(rewards)
    for t in reversed(range(t_len)):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
        adv[:, t] = last_gae
    returns = adv + values
    return masked_whiten(adv, mask), returns


def agg_loss(loss, mask, mode):
    """veRL's agg_loss, except that empty rows are skipped in the seq-mean modes (our choice)."""
    loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
    if mode == "token-mean":
        return masked_mean(loss, mask)
    rows = [i for i in range(loss.shape[0]) if mask[i].sum() > 0]
    seq_sums = [(loss[i] * mask[i]).sum() for i in rows]
    if mode == "seq-mean-token-sum":
        return np.sum(seq_sums) / max(len(rows), 1)
    if mode == "seq-mean-token-mean":
        return np.sum([s / mask[i].sum() for s, i in zip(seq_sums, rows)]) / max(len(rows), 1)
    if mode == "seq-mean-token-sum-norm":
        return np.sum(seq_sums) / mask.shape[-1]
    raise ValueError(mode)


def policy_loss_vanilla(old_lp, lp, adv, mask, low, high, c, mode):
    old_lp, lp, adv = (np.asarray(x, np.float64) for x in (old_lp, lp, adv))
    out = np.zeros_like(lp)
    clipped = np.zeros_like(lp)
    clipped_lower = np.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            log_ratio = min(max(lp[i, t] - old_lp[i, t], -20.0), 20.0)
            ratio = np.exp(log_ratio)
            a = adv[i, t]
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
            l_clip = max(l1, l2)
            clipped[i, t] = float(l2 > l1)
            if a < 0:
                out[i, t] = min(-a * c, l_clip)
                clipped_lower[i, t] = float(l_clip > -a * c)
            else:
                out[i, t] = l_clip
    ppo_kl = masked_mean(-np.clip(lp - old_lp, -20, 20), mask)
    return agg_loss(out, mask, mode), masked_mean(clipped, mask), masked_mean(clipped_lower, mask), ppo_kl


def kl(lp, ref, name):
    d = np.asarray(lp, np.float64) - np.asarray(ref, np.float64)
    name = name.rstrip("+")
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return np.abs(d)
    if name in ("mse", "k2"):
        return 0.5 * d**2
    if name in ("low_var_kl", "k3"):
        x = np.clip(-d, -20, 20)
        return np.clip(np.exp(x) - x - 1, -10, 10)
    raise ValueError(name)


def value_loss(vpreds, returns, values, mask, clip, mode):
    vpreds, returns, values = (np.asarray(x, np.float64) for x in (vpreds, returns, values))
    clipped_v = np.maximum(np.minimum(vpreds, values + clip), values - clip)
    l1, l2 = (vpreds - returns) ** 2, (clipped_v - returns) ** 2
    return 0.5 * agg_loss(np.maximum(l1, l2), mask, mode), masked_mean((l2 > l1).astype(float), mask)


def log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def entropy(logits):
    logp = log_softmax(logits)
    return -(np.exp(logp) * logp).sum(-1)
