"""RL maths as pure, jittable functions: advantages, policy/value losses, KL, loss aggregation,
entropy and token log-probs. Names follow veRL's `core_algos` where the concept is the same.

Shapes: B batch, T response length, D model, V vocab.
"""

from jaxrl_llm.algorithms.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    ADV_INPUTS,
    AdvantageConfig,
    AdvantageEstimator,
    AdvEstimator,
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_opo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    get_adv_estimator_fn,
    group_ids_from_uids,
    register_adv_est,
)
from jaxrl_llm.algorithms.aggregation import (
    LOSS_AGG_MODES,
    LossNorm,
    agg_loss,
    compute_loss_norm,
    token_metric_mean,
)
from jaxrl_llm.algorithms.entropy import compute_entropy_loss, entropy_from_logits
from jaxrl_llm.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    kl_penalty,
    make_kl_controller,
)
from jaxrl_llm.algorithms.logprobs import (
    compute_token_logprobs,
    compute_token_logprobs_naive,
    logprobs_from_logits,
)
from jaxrl_llm.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from jaxrl_llm.algorithms.policy_loss import (
    POLICY_LOSS_REGISTRY,
    PolicyLossConfig,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    register_policy_loss,
)
from jaxrl_llm.algorithms.policy_loss_cov import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_kl_cov,
    select_cov_tokens,
)
from jaxrl_llm.algorithms.policy_loss_variants import (
    compute_policy_loss_cispo,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
)
from jaxrl_llm.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
)
from jaxrl_llm.algorithms.rollout_correction_loss import (  # registers "bypass_mode"
    compute_policy_loss_bypass_mode,
    compute_policy_loss_reinforce,
)
from jaxrl_llm.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATOR_REGISTRY", "KL_ESTIMATORS", "LOSS_AGG_MODES", "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController", "FixedKLController", "LossNorm",
    "agg_loss", "apply_kl_penalty", "compute_entropy_loss", "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage", "compute_kl_loss", "compute_loss_norm", "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage", "compute_token_logprobs", "compute_token_logprobs_naive",
    "compute_value_loss", "entropy_from_logits", "get_adv_estimator_fn", "get_policy_loss_fn",
    "group_ids_from_uids", "kl_penalty", "logprobs_from_logits", "make_kl_controller", "masked_mean",
    "masked_sum", "masked_var", "masked_whiten", "register_adv_est", "register_policy_loss",
    "token_metric_mean",
    # policy losses beyond vanilla
    "PolicyLossConfig", "compute_policy_loss_cispo", "compute_policy_loss_clip_cov", "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv", "compute_policy_loss_dro", "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg", "compute_policy_loss_gspo", "compute_policy_loss_kl_cov", "compute_policy_loss_sapo",
    "select_cov_tokens",
    # rollout correction
    "RolloutCorrectionConfig", "compute_offpolicy_metrics", "compute_policy_loss_bypass_mode",
    "compute_policy_loss_reinforce", "compute_rollout_correction_and_rejection_mask",
    # advantage estimators: the calling convention and the estimators beyond the first five
    "ADV_INPUTS", "AdvEstimator", "AdvantageConfig", "AdvantageEstimator", "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage", "compute_grpo_passk_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage", "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage", "compute_remax_outcome_advantage", "get_adv_estimator",
]
