"""DAPO's overlong reward shaping (veRL's `reward.reward_kwargs.overlong_buffer_cfg`).

A response may use `max_response_length - buffer_len` tokens for free; each token past that costs
`penalty_factor / buffer_len` of reward, so a response that fills the whole budget loses
`penalty_factor`. With `expected = max_response_length - buffer_len`, a response of L tokens (its stop
token included) gets

    min(-(L - expected) / buffer_len * penalty_factor, 0)

added to its score. veRL's DAPO reward manager adds it to the score of every response it scores, in
training and in validation alike, and its extra info then carries `overlong_reward` (the penalty) and
`overlong` (whether it is below 0) when `log` is set.
"""

from __future__ import annotations

import numpy as np


def compute_overlong_penalty(lengths: np.ndarray, *, max_response_length: int, buffer_len: int,
                             penalty_factor: float) -> np.ndarray:
    """The penalty of each response: 0 up to `max_response_length - buffer_len` tokens, then linear.

    Args:
      lengths: [R] int, tokens of each response (the stop token included).
      max_response_length: the response budget (data.max_response_length).
      buffer_len: tokens at the end of the budget over which the penalty grows (0 < buffer_len <= budget).
      penalty_factor: the penalty of a response that fills the budget.
    Returns:
      [R] float64, each <= 0.
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"overlong buffer: len={buffer_len}; need 0 < len <= max_response_length "
                         f"({max_response_length}) (gin: reward.reward_kwargs.overlong_buffer_cfg.len)")
    expected = max_response_length - buffer_len
    exceed = np.asarray(lengths, np.float64) - expected
    return np.minimum(-exceed / buffer_len * penalty_factor, 0.0)


def apply_overlong_penalty(scores: np.ndarray, lengths: np.ndarray, *, max_response_length: int, buffer_len: int,
                           penalty_factor: float, log: bool = False) -> tuple[np.ndarray, dict[str, list]]:
    """Scores with the overlong penalty added, and the extra info veRL's DAPO manager reports.

    Args:
      scores: [R] float, the reward functions' scores.
      lengths: [R] int, tokens of each response.
      log: also return `overlong_reward` ([R] the penalty) and `overlong` ([R] bool: penalised).
    Returns:
      ([R] float32 shaped scores, extra info: {} or {"overlong_reward": [...], "overlong": [...]}).
    """
    penalty = compute_overlong_penalty(lengths, max_response_length=max_response_length, buffer_len=buffer_len,
                                       penalty_factor=penalty_factor)
    shaped = (np.asarray(scores, np.float64) + penalty).astype(np.float32)
    extras = {"overlong_reward": penalty.tolist(), "overlong": (penalty < 0).tolist()} if log else {}
    return shaped, extras


def overlong_metrics(extras: dict[str, list]) -> dict[str, float]:
    """Step metrics of the shaping's extra info: the mean and min penalty and the share penalised.

    veRL reports these keys only in validation (val-aux/<source>/overlong_reward/...); a training step
    logs them as `reward/overlong_reward/{mean,min}` and `reward/overlong/mean`.
    """
    if "overlong_reward" not in extras:
        return {}
    penalty = np.asarray(extras["overlong_reward"], np.float64)
    if penalty.size == 0:
        return {}
    return {"reward/overlong_reward/mean": float(penalty.mean()), "reward/overlong_reward/min": float(penalty.min()),
            "reward/overlong/mean": float(np.mean(np.asarray(extras["overlong"], bool)))}
