"""Float64 numpy references, loop by loop, transcribed from veRL's semantics (not from our code).

They follow veRL's torch code at the level of its loops and dict-of-groups, so a vectorisation
mistake in `jaxrl_llm.algorithms` cannot be mirrored here. Inputs are numpy arrays.
"""

from __future__ import annotations

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


def agg_loss(loss, mask, mode, loss_scale_factor=None):
    """veRL 0.9.1's agg_loss on one batch (dp_size 1): empty rows are skipped in the seq-mean modes."""
    loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "token-sum":
        return np.where(mask > 0, loss, 0).sum()
    rows = [i for i in range(loss.shape[0]) if mask[i].sum() > 0]
    seq_sums = [(loss[i] * mask[i]).sum() for i in rows]
    if mode == "seq-mean-token-sum":
        return np.sum(seq_sums) / max(len(rows), 1)
    if mode == "seq-mean-token-mean":
        return np.sum([s / mask[i].sum() for s, i in zip(seq_sums, rows)]) / max(len(rows), 1)
    if mode == "seq-mean-token-sum-norm":
        factor = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return np.sum(seq_sums) / max(len(rows), 1) / factor
    raise ValueError(mode)


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
