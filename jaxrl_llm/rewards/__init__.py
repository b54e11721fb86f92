"""Reward functions and the batch reward manager: (response, ground_truth, extra_info) -> score.

Importing this package registers the built-in functions: "openai/gsm8k" and "gsm8k" (strict GSM8K
correctness) and "gsm8k_format" (the `#### <number>` format reward). `apply_overlong_penalty` is DAPO's
length shaping of the scores (veRL's overlong buffer).
"""

# Importing the gsm8k and format modules registers their reward functions.
from jaxrl_llm.rewards.custom import load_custom_reward_fn
from jaxrl_llm.rewards.errors import RewardConfigError, RewardError
from jaxrl_llm.rewards.format import FORMAT_REWARD_NAME, compute_format_score
from jaxrl_llm.rewards.gsm8k import compute_score as compute_gsm8k_score
from jaxrl_llm.rewards.gsm8k import extract_solution as extract_gsm8k_solution
from jaxrl_llm.rewards.manager import RewardManager, RewardOutput
from jaxrl_llm.rewards.overlong import apply_overlong_penalty, compute_overlong_penalty, overlong_metrics
from jaxrl_llm.rewards.registry import (
    default_compute_score,
    get_reward_fn,
    register_reward,
    registered_rewards,
)
from jaxrl_llm.rewards.scoring import CustomRewardFunction, resolve_reward_fn

__all__ = [
    "FORMAT_REWARD_NAME",
    "CustomRewardFunction",
    "RewardConfigError",
    "RewardError",
    "RewardManager",
    "RewardOutput",
    "apply_overlong_penalty",
    "compute_format_score",
    "compute_gsm8k_score",
    "compute_overlong_penalty",
    "default_compute_score",
    "extract_gsm8k_solution",
    "get_reward_fn",
    "load_custom_reward_fn",
    "overlong_metrics",
    "register_reward",
    "registered_rewards",
    "resolve_reward_fn",
]
