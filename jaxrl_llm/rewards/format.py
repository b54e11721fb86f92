"""A format reward: does the response end with a well-formed `#### <number>` line?

Useful as a shaping term next to the correctness reward, or to watch whether a policy learns the
answer format that the GSM8K prompt asks for. Decode responses with `skip_special_tokens=True`, so
that an end-of-turn token does not follow the answer line.
"""

from __future__ import annotations

import re

from jaxrl_llm.rewards.registry import register_reward

FORMAT_REWARD_NAME = "gsm8k_format"

# "#### 1,234.5", "#### -7", "#### $12": digits with optional thousands commas and decimals.
_ANSWER_LINE_RE = re.compile(r"#### (?:-\$?|\$-?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def compute_format_score(solution_str: str, score: float = 1.0) -> float:
    """`score` if the last non-blank line of the response is exactly `#### <number>`, else 0.0."""
    lines = [line.strip() for line in solution_str.splitlines() if line.strip()]
    if lines and _ANSWER_LINE_RE.fullmatch(lines[-1]):
        return score
    return 0.0


@register_reward(FORMAT_REWARD_NAME)
def gsm8k_format(solution_str: str, ground_truth=None, extra_info: dict | None = None) -> float:
    """The format reward under the registry's signature; the ground truth is not used."""
    return compute_format_score(solution_str)
