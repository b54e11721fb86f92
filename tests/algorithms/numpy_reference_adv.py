"""Float64 numpy references for the advantage estimators, loop by loop over groups and rows, the way
veRL's `core_algos` computes them (transcribed from its semantics, not from our code), and random
batches that carry every advantage input.

Where veRL would raise (grpo_passk on a group of one) the reference raises too; where veRL gives NaN
(opo on a group of empty rows) the reference gives NaN, so the tests pin down what we return instead.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tests.algorithms.numpy_reference import masked_whiten

# ---- random batches ----------------------------------------------------------------------------------

# Groups of one (twice), two, eight (all-equal scores), three, four, and a pair whose rows are empty.
GROUP_SIZES = (1, 2, 8, 1, 3, 4, 2)
_EQUAL_GROUP, _EMPTY_GROUP = 2, 6


def adv_batch(seed: int = 0, t: int = 7, group_sizes=GROUP_SIZES, holes: bool = False,
              num_empty_rows: int = 2) -> dict:
    """A float32 / int32 numpy batch with every field of `ADV_INPUTS`, plus `token_level_rewards`
    (one score on each response's last token), `dense_rewards` and `response_mask`.

    Rows are shuffled so groups interleave, and group ids are distinct ints in [0, B), not 0..G-1.
    The group of eight has equal scores and equal reward components (0.1 is not exact in float32).
    The last group (when there are 7) has only empty rows, and `num_empty_rows` more rows are empty.
    With `holes`, some tokens inside the responses are masked out, as multi-turn observations are.
    """
    rng = np.random.default_rng(seed)
    b = sum(group_sizes)
    group_of_row = np.repeat(np.arange(len(group_sizes)), group_sizes)
    pick = lambda values: rng.choice(np.asarray(values, np.float64), b)
    scores = pick([0.0, 1.0, 0.5, -0.3, 2.0])
    accuracy, fmt = pick([0.0, 1.0]), pick([0.0, 0.5, 1.0, 0.2])
    lengths = rng.integers(1, t + 1, b)
    equal = group_of_row == _EQUAL_GROUP
    scores[equal], accuracy[equal], fmt[equal] = 0.1, 1.0, 0.1
    lengths[group_of_row == _EMPTY_GROUP] = 0
    lengths[rng.choice(np.flatnonzero(lengths > 0), num_empty_rows, replace=False)] = 0

    labels = rng.choice(b, len(group_sizes), replace=False)
    perm = rng.permutation(b)
    index = labels[group_of_row][perm].astype(np.int32)
    scores, accuracy, fmt, lengths = scores[perm], accuracy[perm], fmt[perm], lengths[perm]

    mask = np.arange(t)[None, :] < lengths[:, None]
    if holes:
        inside = mask & (np.arange(t)[None, :] > 0) & (np.arange(t)[None, :] < lengths[:, None] - 1)
        mask = mask & ~(inside & (rng.random((b, t)) < 0.4))
    mask = mask.astype(np.float32)
    last = np.where(lengths > 0, t - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
    outcome = np.zeros((b, t), np.float32)
    outcome[np.arange(b), last] = scores  # the score sits on the last response token

    f32 = lambda x: np.asarray(x, np.float32)
    old_log_probs = -np.abs(rng.normal(size=(b, t))) - 0.2  # π <= 0.82: w_t is not a float32 cancellation
    pi = np.exp(old_log_probs)
    # Σ_v π_v² lies in [π_t², π_t² + (1 - π_t)²]: the rest of the mass spread thin or on one token.
    sum_pi_squared = pi**2 + (1 - pi) ** 2 * rng.uniform(0.01, 1.0, (b, t))
    return {
        "index": index,
        "response_mask": mask,
        "token_level_rewards": outcome,
        "dense_rewards": f32(rng.normal(size=(b, t))),
        "values": f32(rng.normal(size=(b, t))),
        "reward_baselines": f32(pick([0.0, 1.0, 0.5])),
        "old_log_probs": f32(old_log_probs),
        "sum_pi_squared": f32(sum_pi_squared),
        "rollout_is_weights": f32(rng.uniform(0.3, 2.0, (b, t))),
        "reward_components": {"accuracy": f32(accuracy), "format": f32(fmt)},
    }


# ---- group-relative estimators -----------------------------------------------------------------------


def _f64(x):
    return np.asarray(x, np.float64)


def _groups(index):
    """group id -> the row numbers of its responses, in row order."""
    rows = defaultdict(list)
    for i, g in enumerate(np.asarray(index).tolist()):
        rows[g].append(i)
    return rows


def grpo_scores(scores, index, eps=1e-6, norm_by_std=True):
    scores = _f64(scores)
    out = np.zeros_like(scores)
    for rows in _groups(index).values():
        group = scores[rows]
        mean, std = (0.0, 1.0) if len(rows) == 1 else (group.mean(), group.std(ddof=1))
        for i in rows:
            out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return out


def grpo(rewards, mask, index, eps=1e-6, norm_by_std=True):
    return grpo_scores(_f64(rewards).sum(-1), index, eps, norm_by_std)[:, None] * mask


def rloo(rewards, mask, index):
    scores = _f64(rewards).sum(-1)
    out = scores.copy()  # a group of one keeps its score
    for rows in _groups(index).values():
        n = len(rows)
        for i in rows:
            if n > 1:
                others = [scores[j] for j in rows if j != i]
                out[i] = scores[i] - np.mean(others)
    return out[:, None] * mask


def reinforce_pp_baseline(rewards, mask, index):
    scores = _f64(rewards).sum(-1)
    out = scores.copy()
    for rows in _groups(index).values():
        if len(rows) > 1:
            mean = scores[rows].mean()
            for i in rows:
                out[i] = scores[i] - mean
    adv = np.tile(out[:, None], (1, mask.shape[1])) * mask
    return masked_whiten(adv, mask) * mask


def opo(rewards, mask, index):
    """veRL's semantics, NaN included: a group of >= 2 rows whose lengths sum to 0 divides 0 by 0."""
    scores, lengths = _f64(rewards).sum(-1), _f64(mask).sum(-1)
    out = np.zeros_like(scores)
    for rows in _groups(index).values():
        if len(rows) == 1:
            baseline = 0.0
        else:
            with np.errstate(invalid="ignore"):
                baseline = np.sum(lengths[rows] * scores[rows]) / np.sum(lengths[rows])
        for i in rows:
            out[i] = scores[i] - baseline
    return out[:, None] * mask


def gpg(rewards, mask, index, f_norm=1.0):
    scores = _f64(rewards).sum(-1)
    alpha = len(scores) / max(np.count_nonzero(np.asarray(rewards, np.float32).sum(-1)), 1)
    out = np.zeros_like(scores)
    for rows in _groups(index).values():
        mean = 0.0 if len(rows) == 1 else scores[rows].mean()
        for i in rows:
            out[i] = alpha * (scores[i] - mean) / f_norm
    return out[:, None] * mask


def grpo_passk(rewards, mask, index, eps=1e-6, norm_by_std=True):
    scores = _f64(rewards).sum(-1)
    out = np.zeros_like(scores)
    for g, rows in _groups(index).items():
        if len(rows) < 2:
            raise ValueError(f"pass@k needs two responses in group {g}")
        order = sorted(rows, key=lambda i: -scores[i])  # stable: the first of tied bests wins
        adv = scores[order[0]] - scores[order[1]]
        if norm_by_std:
            adv = adv / (scores[rows].std(ddof=1) + eps)
        out[order[0]] = adv
    return out[:, None] * mask


def gdpo(components, mask, index, keys, weights=None, eps=1e-6, norm_by_std=True):
    weights = [1.0] * len(keys) if weights is None else weights
    total = np.zeros(mask.shape)
    for key, w in zip(keys, weights):
        # veRL places each component on the last response token and sums over T: the component itself.
        total += w * grpo_scores(components[key], index, eps, norm_by_std)[:, None] * mask
    return masked_whiten(total, mask) * mask


# ---- per-token estimators ----------------------------------------------------------------------------


def gae(rewards, values, mask, gamma, lam):
    rewards, values = _f64(rewards), _f64(values)
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


def reinforce_pp(rewards, mask, gamma):
    """veRL 0.9.1: a masked token is skipped (the running return carries through it) and returns 0."""
    rewards = _f64(rewards)
    returns = np.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:
                running = rewards[i, t] + gamma * running
                returns[i, t] = running
    return masked_whiten(returns, mask) * mask, returns


def reward_to_go(rewards, mask):
    rewards = _f64(rewards) * mask
    out = np.zeros_like(rewards)
    for t in range(rewards.shape[1]):
        out[:, t] = rewards[:, t:].sum(-1)
    return out


def remax(rewards, mask, baselines):
    returns = reward_to_go(rewards, mask)
    return returns - _f64(baselines)[:, None] * mask, returns


def _path_variance(old_log_probs, sum_pi_squared, mask, is_weights):
    w = 1 - 2 * np.exp(_f64(old_log_probs)) + _f64(sum_pi_squared)
    if is_weights is not None:
        w = w * _f64(is_weights) ** 2
    return np.cumsum(w * mask, axis=-1)


def _zero_tail(baselines, rows, lengths):
    """The only longest row of a group gets no baseline from the second-longest length on."""
    ordered = sorted(int(lengths[i]) for i in rows)
    longest = [i for i in rows if lengths[i] == ordered[-1]]
    if len(longest) == 1 and ordered[-1] > ordered[-2]:
        baselines[longest[0], ordered[-2]:] = 0.0


def optimal_token_baseline(rewards, mask, index, old_log_probs, sum_pi_squared, is_weights=None,
                           handle_zero_tail=True, eps=1e-8):
    mask = _f64(mask)
    returns = reward_to_go(rewards, mask)
    w_cum = _path_variance(old_log_probs, sum_pi_squared, mask, is_weights)
    lengths = mask.sum(-1)
    baselines = np.zeros_like(returns)
    for rows in _groups(index).values():
        if len(rows) == 1:
            continue
        num = np.sum([returns[i] * w_cum[i] * mask[i] for i in rows], axis=0)  # [T]
        den = np.sum([w_cum[i] * mask[i] for i in rows], axis=0) + eps
        for i in rows:
            baselines[i] = num / den
        if handle_zero_tail:
            _zero_tail(baselines, rows, lengths)
    return (returns - baselines) * mask, returns


def tir_optimal_token_baseline(rewards, mask, index, old_log_probs, sum_pi_squared, is_weights=None,
                               handle_zero_tail=True, eps=1e-8):
    mask = _f64(mask)
    returns = reward_to_go(rewards, mask)
    w_cum = _path_variance(old_log_probs, sum_pi_squared, mask, is_weights)
    b, t = mask.shape
    lengths = mask.sum(-1).astype(int)
    # Pack each row's response tokens to the left, dropping the masked-out ones.
    packed_w, packed_g = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        keep = mask[i] > 0
        packed_w[i, :lengths[i]] = w_cum[i, keep]
        packed_g[i, :lengths[i]] = returns[i, keep]
    baselines = np.zeros((b, t))
    members = _groups([g if lengths[i] > 0 else -1 for i, g in enumerate(np.asarray(index).tolist())])
    members.pop(-1, None)  # empty rows belong to no group
    for rows in members.values():
        if len(rows) == 1:
            continue
        b_star = np.sum([packed_g[i] * packed_w[i] for i in rows], axis=0) / (
            np.sum([packed_w[i] for i in rows], axis=0) + eps)
        for i in rows:
            baselines[i] = b_star
        if handle_zero_tail:
            _zero_tail(baselines, rows, lengths)
    advantages = np.zeros((b, t))
    for i in range(b):
        keep = mask[i] > 0
        advantages[i, keep] = packed_g[i, :lengths[i]] - baselines[i, :lengths[i]]
    return advantages, returns
