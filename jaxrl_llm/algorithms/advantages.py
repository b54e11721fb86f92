"""Advantage estimators with veRL's names and semantics (`verl/trainer/ppo/core_algos.py`), behind one
calling convention:

    est = get_adv_estimator("grpo")
    adv, returns = est.fn(token_level_rewards, response_mask, *, config=AdvantageConfig(...),
                          **{k: batch[k] for k in est.inputs})

`est.inputs` names the batch fields the estimator reads (a subset of `ADV_INPUTS`; see
`advantages_base` for their shapes). Every estimator is pure and jittable, with `config` static.

Where they live:
  advantages_base   the config, the registry, group ids and group statistics
  advantages_group  grpo (= grpo_vectorized), rloo (= rloo_vectorized), reinforce_plus_plus_baseline,
                    opo, gpg, grpo_passk, gdpo: one score per response, compared within its group
  advantages_token  gae, reinforce_plus_plus, remax, optimal_token_baseline,
                    tir_optimal_token_baseline: a different advantage per token

Importing this module (or `jaxrl_llm.algorithms`) registers them all.
"""

from jaxrl_llm.algorithms.advantages_base import (
    ADV_ESTIMATOR_REGISTRY,
    ADV_INPUTS,
    AdvantageConfig,
    AdvantageEstimator,
    AdvEstimator,
    get_adv_estimator,
    get_adv_estimator_fn,
    group_ids_from_uids,
    register_adv_est,
)
from jaxrl_llm.algorithms.advantages_group import (
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from jaxrl_llm.algorithms.advantages_token import (
    compute_gae_advantage_return,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
)

__all__ = [
    "ADV_ESTIMATOR_REGISTRY", "ADV_INPUTS", "AdvEstimator", "AdvantageConfig", "AdvantageEstimator",
    "compute_gae_advantage_return", "compute_gdpo_outcome_advantage", "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage", "compute_grpo_passk_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage", "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage", "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage", "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage", "get_adv_estimator", "get_adv_estimator_fn", "group_ids_from_uids",
    "register_adv_est",
]
