"""What every advantage estimator shares: its config, its calling convention, the registry by veRL's
names, and the group statistics of outcome scores.

The convention. Every registered estimator is called as

    adv, returns = est.fn(token_level_rewards, response_mask, *, config=AdvantageConfig(...),
                          **{k: batch[k] for k in est.inputs})

with `token_level_rewards` and `response_mask` [B, T], and `est.inputs` naming the other batch fields
it reads, a subset of `ADV_INPUTS`:

  index               [B] int32 dense group ids in [0, B) (responses to one prompt share an id)
  values              [B, T] critic values (gae)
  reward_baselines    [B] float, the score of the greedy response to the same prompt (remax)
  old_log_probs       [B, T] log-probs of the sampled tokens under the old policy
  sum_pi_squared      [B, T] Σ_v π(v)² of the old policy at each token (`compute_token_logprobs`)
  rollout_is_weights  [B, T] rollout-correction importance weights; may be None (not in use)
  reward_components   dict name -> [B] float, one per `config.gdpo_reward_keys` (gdpo)

Both outputs are [B, T] float32. The estimators are pure and jittable: `config` is a frozen
dataclass, so pass it as a static argument (or close over it) under `jit`.

Group ids. veRL groups by the prompt's uid string; here `index` holds dense ints in [0, B).
`group_ids_from_uids` turns uid strings (or any hashable keys) into such ids on the host. Ids outside
[0, B) are dropped by `segment_sum` and give wrong results, so do not pass raw hashes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from enum import Enum, StrEnum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """veRL's algorithm.* values the estimators read (hashable, static under jit).

    Attributes:
      gamma: discount (gae, reinforce_plus_plus).
      lam: GAE lambda (gae).
      norm_adv_by_std_in_grpo: divide by the group std (grpo, grpo_vectorized, grpo_passk, gdpo);
        False is Dr.GRPO.
      epsilon: added to the group std (grpo, grpo_vectorized, grpo_passk, gdpo).
      gdpo_reward_keys: the reward components gdpo normalises one by one (required for gdpo).
      gdpo_reward_weights: their weights in the sum; None weighs each by 1.
      handle_zero_tail: optimal-token-baseline estimators: the only longest response of a group gets
        no baseline past the second-longest one's length (veRL's keyword of the same name).
      otb_epsilon: optimal-token-baseline estimators: added to the baseline's denominator (veRL's
        `epsilon` keyword of those functions, whose default 1e-8 differs from GRPO's 1e-6).
    """

    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6
    gdpo_reward_keys: tuple[str, ...] | None = None
    gdpo_reward_weights: tuple[float, ...] | None = None
    handle_zero_tail: bool = True
    otb_epsilon: float = 1e-8


DEFAULT_CONFIG = AdvantageConfig()

ADV_INPUTS = ("index", "values", "reward_baselines", "old_log_probs", "sum_pi_squared", "rollout_is_weights",
              "reward_components")


class AdvantageEstimator(StrEnum):
    """veRL's estimator names, for code that spells them as an enum (the registry takes either)."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


class AdvEstimator(NamedTuple):
    """A registered estimator: the function and the batch fields (from `ADV_INPUTS`) it reads."""

    fn: Callable[..., tuple[jax.Array, jax.Array]]
    inputs: tuple[str, ...]


ADV_ESTIMATOR_REGISTRY: dict[str, AdvEstimator] = {}


def _name(name_or_enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(name_or_enum, *, inputs: Sequence[str] = ()) -> Callable:
    """Decorator registering an advantage estimator under a name (or a str Enum's value).

    One function may be registered under several names (veRL's `*_vectorized` aliases). Registering
    a different function, or the same one with other inputs, under a taken name is an error.

    Args:
      name_or_enum: the registry name.
      inputs: the batch fields the function takes as keyword arguments, a subset of `ADV_INPUTS`.
    """
    inputs = tuple(inputs)
    unknown = [k for k in inputs if k not in ADV_INPUTS]
    if unknown:
        raise ValueError(f"unknown advantage inputs {unknown}; known: {ADV_INPUTS}")

    def decorator(fn):
        name = _name(name_or_enum)
        entry = AdvEstimator(fn, inputs)
        taken = ADV_ESTIMATOR_REGISTRY.get(name)
        if taken is not None and (taken.fn is not fn or taken.inputs != inputs):
            raise ValueError(f"advantage estimator {name!r} is already registered to "
                             f"{taken.fn.__qualname__} with inputs {taken.inputs}")
        ADV_ESTIMATOR_REGISTRY[name] = entry
        return fn

    return decorator


def get_adv_estimator(name_or_enum) -> AdvEstimator:
    """The estimator registered under `name` (veRL's names: "gae", "grpo", ...) and its inputs."""
    name = _name(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def get_adv_estimator_fn(name_or_enum) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The function registered under `name` (veRL's `get_adv_estimator_fn`)."""
    return get_adv_estimator(name_or_enum).fn


# ---- group statistics -------------------------------------------------------------------------------


def group_ids_from_uids(uids: Sequence[Any] | np.ndarray) -> np.ndarray:
    """Dense int32 group ids in [0, B) from per-response keys (host side, numpy).

    Args:
      uids: [B] hashable keys, e.g. veRL's `uid` strings; equal keys form one group.
    Returns:
      [B] int32 ids, numbered in order of first appearance.
    """
    first_seen: dict[Any, int] = {}
    return np.asarray([first_seen.setdefault(u, len(first_seen)) for u in uids], dtype=np.int32)


def group_sum(x: jax.Array, index: jax.Array) -> jax.Array:
    """Each row's group total: [B, ...] -> [B, ...] (the sum over the rows sharing its id)."""
    return jax.ops.segment_sum(x, index, num_segments=index.shape[0])[index]


def group_max(x: jax.Array, index: jax.Array) -> jax.Array:
    """Each row's group maximum: [B, ...] -> [B, ...]."""
    return jax.ops.segment_max(x, index, num_segments=index.shape[0])[index]


def group_stats(scores: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-response group size, group-centred score and unbiased group std.

    Scores are shifted by their group's maximum before averaging. The shift cancels in (s - mean)
    but makes a group of equal scores centre to exactly 0 in float32, so its std is exactly 0 and
    GRPO gives 0 rather than rounding noise / epsilon.

    Args:
      scores: [B] float32.
      index: [B] int group ids in [0, B).
    Returns:
      count [B], centred [B] = s - group mean, std [B] (unbiased, as torch.std; 0 for a group of one).
    """
    count = group_sum(jnp.ones_like(scores), index)  # [B]
    shifted = scores - group_max(scores, index)  # [B]
    centred = shifted - group_sum(shifted, index) / count  # [B]
    std = jnp.sqrt(group_sum(jnp.square(centred), index) / jnp.maximum(count - 1, 1))  # [B]
    return count, centred, std


def outcome_scores(token_level_rewards: jax.Array) -> jax.Array:
    """[B, T] -> [B] float32: veRL sums the rewards over all T (the reward sits on the EOS token)."""
    return jnp.sum(token_level_rewards.astype(jnp.float32), axis=-1)


def reward_to_go(token_level_rewards: jax.Array, response_mask: jax.Array) -> jax.Array:
    """Undiscounted return from each position: Σ_{s >= t} r_s · mask_s, [B, T] float32.

    Not re-masked: a masked slot inside a response (a multi-turn observation) holds the return of
    the response tokens after it, and padding after the last response token holds 0.
    """
    masked = token_level_rewards.astype(jnp.float32) * response_mask.astype(jnp.float32)
    return jax.lax.cumsum(masked, axis=1, reverse=True)
