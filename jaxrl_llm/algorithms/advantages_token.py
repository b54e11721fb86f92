"""Estimators with a different advantage at each token: gae, reinforce_plus_plus, remax, and the
optimal token baseline (optimal_token_baseline, tir_optimal_token_baseline).

Time recursions run as `lax.scan` / `lax.cumsum` over T; the optimal token baseline reduces over
prompt groups with segment sums over `index`. Calling convention and shapes: see `advantages_base`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.algorithms.advantages_base import (
    DEFAULT_CONFIG,
    AdvantageConfig,
    AdvantageEstimator,
    group_max,
    group_sum,
    register_adv_est,
    reward_to_go,
)
from jaxrl_llm.algorithms.masked import masked_whiten


@register_adv_est(AdvantageEstimator.GAE, inputs=("values",))
def compute_gae_advantage_return(token_level_rewards: jax.Array, response_mask: jax.Array, *, values: jax.Array,
                                 config: AdvantageConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over the masked response, then masked whitening.

    veRL's loop skips masked tokens (observation tokens in multi-turn, padding after EOS): there the
    running next-value and GAE carry through unchanged, so a masked token neither bootstraps nor
    adds a TD error. Runs as a reverse `lax.scan` over T. An empty row's raw advantages are 0, so
    after whitening it holds -mean / std of the batch (not re-masked, as in veRL).

    Args:
      token_level_rewards: [B, T] float.
      response_mask: [B, T] 0/1.
      values: [B, T] float, the critic's values of the response tokens.
      config: reads `gamma` and `lam`.
    Returns:
      advantages [B, T] (whitened over the mask, not re-masked, as in veRL),
      returns [B, T] = raw GAE advantages + values.
    """
    gamma, lam = config.gamma, config.lam
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


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array, *,
                                                  config: AdvantageConfig = DEFAULT_CONFIG
                                                  ) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++ (arXiv:2501.03262): discounted return-to-go per token, whitened over the batch's mask.

    As in veRL 0.9.1, a masked token (a multi-turn observation, or padding) is skipped: the running
    return carries through it unchanged and its own reward is dropped, and its return is 0. So
    rewards placed after the last response token never leak into the response.

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1.
      config: reads `gamma`.
    Returns:
      advantages [B, T] (whitened, masked), returns [B, T] (unwhitened, masked).
    """
    gamma = config.gamma
    rewards = token_level_rewards.astype(jnp.float32)
    mask = response_mask.astype(jnp.float32)

    def step(running, xs):
        r, m = xs  # [B], [B]
        ret = r + gamma * running
        return m * ret + (1 - m) * running, m * ret

    zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
    _, ret_t = jax.lax.scan(step, zeros, (rewards.T, mask.T), reverse=True)  # [T, B]
    returns = ret_t.T  # [B, T]
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REMAX, inputs=("reward_baselines",))
def compute_remax_outcome_advantage(token_level_rewards: jax.Array, response_mask: jax.Array, *,
                                    reward_baselines: jax.Array, config: AdvantageConfig = DEFAULT_CONFIG
                                    ) -> tuple[jax.Array, jax.Array]:
    """ReMax (arXiv:2310.10505): reward-to-go minus the greedy response's score.

    Neither output is re-masked (as in veRL): padding after a response has return 0 and advantage
    0, but a masked slot inside a response keeps its reward-to-go. `config` is unused.

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1.
      reward_baselines: [B] float, the score of the greedy (argmax) response to the same prompt.
    Returns:
      advantages [B, T] = returns - baseline · mask; returns [B, T] = Σ_{s >= t} r_s · mask_s.
    """
    del config
    returns = reward_to_go(token_level_rewards, response_mask)  # [B, T]
    baseline = jnp.asarray(reward_baselines, jnp.float32)[:, None] * response_mask.astype(jnp.float32)
    return returns - baseline, returns


# ---- optimal token baseline -------------------------------------------------------------------------

_OTB_INPUTS = ("index", "old_log_probs", "sum_pi_squared", "rollout_is_weights")


def _path_variance(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights):
    """W_t = Σ_{j <= t} mask_j · ρ_j² · (1 - 2 π_j + Σ_v π_v²), [B, T] float32 (ρ = 1 without weights).

    1 - 2 π_t + Σ π² = ||onehot(y_t) - π||², the squared norm of the token's score function w.r.t. the
    logits: how much the step can move the gradient.
    """
    pi = jnp.exp(old_log_probs.astype(jnp.float32))
    w = 1.0 - 2.0 * pi + sum_pi_squared.astype(jnp.float32)  # [B, T]
    if rollout_is_weights is not None:
        w = w * jnp.square(rollout_is_weights.astype(jnp.float32))
    return jnp.cumsum(w * response_mask.astype(jnp.float32), axis=-1)


def _optimal_token_baseline(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                            rollout_is_weights, config: AdvantageConfig, *, pack: bool):
    """Shared body of both OTB estimators; `pack` (static) aligns each row's response tokens by their
    rank among the row's mask tokens instead of by column, and leaves empty rows out of the groups."""
    b, t = token_level_rewards.shape
    mask = response_mask.astype(jnp.float32)
    present = mask != 0  # [B, T]
    returns = reward_to_go(token_level_rewards, mask)  # [B, T]
    w_cum = _path_variance(old_log_probs, sum_pi_squared, mask, rollout_is_weights)  # [B, T]
    lengths = jnp.sum(present, axis=-1).astype(jnp.int32)  # [B]
    rows = jnp.arange(b)[:, None]
    if pack:
        slot = jnp.clip(jnp.cumsum(present, axis=-1) - 1, 0, t - 1)  # [B, T] rank among the row's tokens
        member = lengths > 0
        to_slots = lambda x: jnp.zeros((b, t), jnp.float32).at[rows, slot].add(jnp.where(present, x, 0.0))
    else:
        slot = jnp.broadcast_to(jnp.arange(t), (b, t))
        member = jnp.ones((b,), bool)
        to_slots = lambda x: jnp.where(present, x, 0.0)

    # B*_k = Σ_group G·W / (Σ_group W + eps) at each slot k, for the whole group.
    num = jax.ops.segment_sum(to_slots(returns * w_cum), index, num_segments=b)  # [groups, T]
    den = jax.ops.segment_sum(to_slots(w_cum), index, num_segments=b) + config.otb_epsilon
    baseline = (num / den)[index[:, None], slot]  # [B, T], each token's slot in its group
    size = group_sum(member.astype(jnp.int32), index)  # [B] responses in the group
    use = (size > 1)[:, None] & jnp.ones((1, t), bool)  # a group of one has no baseline
    if config.handle_zero_tail:
        # The only longest response of a group gets no baseline past the second-longest's length.
        longest = group_max(lengths, index)
        num_longest = group_sum((lengths == longest).astype(jnp.int32), index)
        second = group_max(jnp.where(lengths == longest, -1, lengths), index)
        alone = (lengths == longest) & (num_longest == 1)  # implies longest > second
        use = use & ~(alone[:, None] & (slot >= second[:, None]))
    advantages = (returns - jnp.where(use, baseline, 0.0)) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.OPTIMAL_TOKEN_BASELINE, inputs=_OTB_INPUTS)
def compute_optimal_token_baseline_advantage(token_level_rewards: jax.Array, response_mask: jax.Array, *,
                                             index: jax.Array, old_log_probs: jax.Array,
                                             sum_pi_squared: jax.Array, rollout_is_weights: jax.Array | None = None,
                                             config: AdvantageConfig = DEFAULT_CONFIG
                                             ) -> tuple[jax.Array, jax.Array]:
    """Optimal token baseline (OTB): a per-token, per-group baseline weighted by path variance.

    G_t is the undiscounted reward-to-go and W_t the cumulative path-variance proxy
    Σ_{j <= t} ρ_j² (1 - 2 π_j + Σ_v π_v²) over the response tokens (ρ the rollout IS weights, 1
    without). At each column t every response of a group gets the baseline
        B*_t = Σ_i G_i,t W_i,t m_i,t / (Σ_i W_i,t m_i,t + otb_epsilon)
    and A_t = (G_t - B*_t) · m_t. A group of one (empty rows count as members here) has no baseline:
    A = G · m. With `config.handle_zero_tail`, the group's only longest response gets no baseline
    from column (second-longest length) on, where it has no peers. Empty rows give 0.

    Args:
      token_level_rewards: [B, T] float; response_mask: [B, T] 0/1; index: [B] dense group ids.
      old_log_probs: [B, T] log-probs of the sampled tokens under the old policy.
      sum_pi_squared: [B, T] Σ_v π_old(v)² at each token (from `compute_token_logprobs`).
      rollout_is_weights: [B, T] truncated IS weights, or None.
      config: reads `handle_zero_tail`, `otb_epsilon`.
    Returns:
      advantages [B, T] (masked), returns [B, T] = G (not re-masked; 0 on trailing padding).
    """
    return _optimal_token_baseline(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                   rollout_is_weights, config, pack=False)


@register_adv_est(AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE, inputs=_OTB_INPUTS)
def compute_multi_turn_optimal_token_baseline_advantage(
        token_level_rewards: jax.Array, response_mask: jax.Array, *, index: jax.Array, old_log_probs: jax.Array,
        sum_pi_squared: jax.Array, rollout_is_weights: jax.Array | None = None,
        config: AdvantageConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
    """Optimal token baseline for multi-turn (tool-integrated) responses, where the mask has holes.

    As `compute_optimal_token_baseline_advantage`, except that responses are compared by their k-th
    response token rather than their t-th column: each row's mask tokens are packed to the left
    (observation tokens dropped), the baseline B*_k is computed on the packed rows and written back
    to the mask tokens, and handle_zero_tail counts lengths in mask tokens. Empty rows are left out
    of the groups (a group with one non-empty row has no baseline) and get 0.

    It needs no field beyond the optimal token baseline's: the turn structure is read from
    `response_mask` alone. In our single-turn setting each row's mask is one run starting at column
    0, so packing changes nothing and this gives optimal_token_baseline's numbers, except in a group
    whose responses are all empty but one when `handle_zero_tail` is off (there OTB still subtracts
    G·W / (W + otb_epsilon) ≈ G from that response; this gives it no baseline).

    Args and returns: as `compute_optimal_token_baseline_advantage`.
    """
    return _optimal_token_baseline(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                   rollout_is_weights, config, pack=True)
