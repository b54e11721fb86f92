"""Advantage estimators with veRL's names, inputs and outputs (`verl/trainer/ppo/core_algos.py`).

Every estimator maps `token_level_rewards` [B, T] (and the `response_mask` [B, T]) to
`(advantages [B, T], returns [B, T])`. They are pure and jittable; outcome estimators group
responses with `index` [B] int and reduce over groups with `jax.ops.segment_sum` (`num_segments=B`
is static), so there is no Python loop over the batch and any mix of group sizes works.

Group ids. veRL groups by the prompt's uid string; here `index` must hold dense ints in [0, B)
(responses to one prompt share an id). `group_ids_from_uids` turns uid strings (or any hashable
keys) into such ids on the host. Ids outside [0, B) are dropped by `segment_sum` and give wrong
results, so do not pass raw hashes.

Hyperparameters that select a code path (`norm_adv_by_std_in_grpo`) are Python values: mark them
static (or close over them) under `jit`. Plain floats (gamma, lam, epsilon) may be traced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.algorithms.masked import masked_whiten

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


def _group_stats(scores: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-response group size, group-centred score and unbiased group std.

    Scores are shifted by their group's maximum before averaging. The shift cancels in (s - mean)
    but makes a group of equal scores centre to exactly 0 in float32, so its std is exactly 0 and
    GRPO gives 0 rather than rounding noise / epsilon.

    Args:
      scores: [B] float32.
      index: [B] int group ids in [0, B).
    Returns:
      count [B], centred [B] = s - group mean, std [B] (unbiased; 0 for a group of one).
    """
    b = scores.shape[0]
    seg_sum = lambda x: jax.ops.segment_sum(x, index, num_segments=b)
    count = seg_sum(jnp.ones_like(scores))[index]  # [B]
    shifted = scores - jax.ops.segment_max(scores, index, num_segments=b)[index]  # [B]
    centred = shifted - seg_sum(shifted)[index] / count  # [B]
    sq = seg_sum(jnp.square(centred))[index]  # [B]
    std = jnp.sqrt(sq / jnp.maximum(count - 1, 1))  # [B]
    return count, centred, std


def _outcome_scores(token_level_rewards: jax.Array) -> jax.Array:
    """[B, T] -> [B] float32: veRL sums the rewards over all T (the reward sits on the EOS token)."""
    return jnp.sum(token_level_rewards.astype(jnp.float32), axis=-1)


# ---- estimators --------------------------------------------------------------------------------------


def compute_gae_advantage_return(token_level_rewards: jax.Array, values: jax.Array,
                                 response_mask: jax.Array, gamma, lam) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over the masked response, then masked whitening.

    veRL's loop skips masked tokens (observation tokens in multi-turn, padding after EOS): there the
    running next-value and GAE carry through unchanged, so a masked token neither bootstraps nor
    adds a TD error. Runs as a reverse `lax.scan` over T.

    Args:
      token_level_rewards: [B, T] float.
      values: [B, T] float, the critic's values of the response tokens.
      response_mask: [B, T] 0/1.
      gamma: discount; lam: GAE lambda (floats, may be traced).
    Returns:
      advantages [B, T] (whitened over the mask, not re-masked, as in veRL),
      returns [B, T] = raw GAE advantages + values.
    """
    rewards = token_level_rewards.astype(jnp.float32)
    vals = values.astype(jnp.float32)
    mask = response_mask.astype(jnp.float32)

    def step(carry, xs):
        next_value, last_gae = carry  # [B], [B]
        r, v, m = xs  # [B] each
        delta = r + gamma * next_value - v
        gae = delta + gamma * lam * last_gae
        next_value = v * m + (1 - m) * next_value
        last_gae = gae * m + (1 - m) * last_gae
        return (next_value, last_gae), last_gae

    zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (rewards.T, vals.T, mask.T), reverse=True)  # [T, B]
    advantages = adv_t.T  # [B, T]
    returns = advantages + vals
    return masked_whiten(advantages, mask), returns


def compute_grpo_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array,
                                   index: jax.Array, epsilon: float = 1e-6,
                                   norm_adv_by_std_in_grpo: bool = True) -> tuple[jax.Array, jax.Array]:
    """GRPO: each response's score relative to its group, (score - mean) / (std + epsilon).

    std is unbiased (torch.std). A group of one uses mean 0 and std 1, i.e. keeps its raw score
    (veRL). With `norm_adv_by_std_in_grpo=False` (Dr.GRPO) the std division is dropped.

    Args:
      token_level_rewards: [B, T] float; the score of a response is its sum over T.
      response_mask: [B, T] 0/1.
      index: [B] int dense group ids in [0, B).
      epsilon: added to the std.
      norm_adv_by_std_in_grpo: static bool.
    Returns:
      (advantages, returns), both [B, T] = the per-response advantage broadcast over the mask.
    """
    scores = _outcome_scores(token_level_rewards)  # [B]
    count, centred, std = _group_stats(scores, index)
    single = count == 1
    centred = jnp.where(single, scores, centred)
    if norm_adv_by_std_in_grpo:
        adv = centred / (jnp.where(single, 1.0, std) + epsilon)
    else:
        adv = centred
    adv = adv[:, None] * response_mask.astype(jnp.float32)  # [B, T]
    return adv, adv


def compute_rloo_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array,
                                   index: jax.Array, epsilon: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """RLOO: score minus the mean of the other responses of its group, n/(n-1)·(r - group mean).

    A group of one keeps its raw score. `epsilon` is unused (kept for veRL's signature).

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1; index: [B] dense group ids.
    Returns:
      (advantages, returns), both [B, T].
    """
    del epsilon
    scores = _outcome_scores(token_level_rewards)  # [B]
    count, centred, _ = _group_stats(scores, index)
    adv = jnp.where(count > 1, centred * count / jnp.maximum(count - 1, 1), scores)  # [B]
    adv = adv[:, None] * response_mask.astype(jnp.float32)
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array,
                                                  gamma) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++: discounted return-to-go per token, whitened over the whole batch's mask.

    The running return is reset after each masked token (veRL: "reset after EOS"), so padding to
    the right of a response does not leak into it.

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1; gamma: discount.
    Returns:
      advantages [B, T] (whitened, masked), returns [B, T] (unwhitened, not masked).
    """
    rewards = token_level_rewards.astype(jnp.float32)
    mask = response_mask.astype(jnp.float32)

    def step(running, xs):
        r, m = xs  # [B], [B]
        ret = r + gamma * running
        return ret * m, ret

    zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
    _, ret_t = jax.lax.scan(step, zeros, (rewards.T, mask.T), reverse=True)  # [T, B]
    returns = ret_t.T  # [B, T]
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards: jax.Array, response_mask: jax.Array, index: jax.Array,
        epsilon: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++ with a group baseline: subtract the group mean, then whiten over the batch.

    A group of one uses mean 0. `epsilon` is unused (kept for veRL's signature).

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1; index: [B] dense group ids.
    Returns:
      (advantages, returns), both [B, T], whitened over the mask and masked.
    """
    del epsilon
    scores = _outcome_scores(token_level_rewards)  # [B]
    count, centred, _ = _group_stats(scores, index)
    adv = jnp.where(count == 1, scores, centred)
    mask = response_mask.astype(jnp.float32)
    adv = adv[:, None] * mask  # [B, T]
    adv = masked_whiten(adv, mask) * mask
    return adv, adv


# ---- registry ----------------------------------------------------------------------------------------

ADV_ESTIMATOR_REGISTRY: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {}


def _name(name_or_enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(name_or_enum) -> Callable:
    """Decorator registering an advantage estimator under a name (or a str Enum's value).

    Registering a different function under a taken name is an error, as in veRL.
    """

    def decorator(fn):
        name = _name(name_or_enum)
        if ADV_ESTIMATOR_REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered to "
                             f"{ADV_ESTIMATOR_REGISTRY[name].__qualname__}")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The advantage estimator registered under `name` (veRL's names: "gae", "grpo", ...)."""
    name = _name(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


register_adv_est("gae")(compute_gae_advantage_return)
register_adv_est("grpo")(compute_grpo_outcome_advantage)
register_adv_est("rloo")(compute_rloo_outcome_advantage)
register_adv_est("reinforce_plus_plus")(compute_reinforce_plus_plus_outcome_advantage)
register_adv_est("reinforce_plus_plus_baseline")(compute_reinforce_plus_plus_baseline_outcome_advantage)
