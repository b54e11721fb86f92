"""GSM8K answer extraction and scoring, with veRL's semantics (`verl.utils.reward_score.gsm8k`).

Only the tail of a response is searched: final answers sit at the end, and regexes over very long
generations are slow. "strict" needs the `#### <number>` format the prompt asks for (so it also
rewards formatting); "flexible" takes the last number anywhere in the tail.
"""

from __future__ import annotations

import re

from jaxrl_llm.rewards.registry import register_reward

# The data_source values that score as GSM8K; `scripts/prepare_gsm8k.py` writes the first.
DATA_SOURCES = ("openai/gsm8k", "gsm8k")

# How many trailing characters of a response are searched (veRL's value).
SOLUTION_CLIP_CHARS = 300

_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER_RE = re.compile(r"(\-?[0-9\.\,]+)")
# Regex hits that hold no digit; "flexible" skips them when looking for the last number.
_NOT_A_NUMBER = ("", ".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a response, with `,` and `$` removed; None if there is none.

    Args:
      solution_str: the decoded response.
      method: "strict" takes the last `#### <number>` in the tail; "flexible" the last number there.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extract_solution: method={method!r}; use 'strict' or 'flexible'")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT_RE.findall(tail)
        if not matches:
            return None
        answer = matches[-1]
    else:
        candidates = [m for m in _NUMBER_RE.findall(tail) if m not in _NOT_A_NUMBER]
        if not candidates:
            return None
        answer = candidates[-1]
    return answer.replace(",", "").replace("$", "")


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """`score` if the extracted answer equals `ground_truth` (as strings), `format_score` if an answer
    was found but is wrong, and 0 if no answer was found (veRL semantics)."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    # A hand-written jsonl may store the answer as an int; veRL's parquet always has a string.
    truth = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
    return score if answer == truth else format_score


@register_reward(*DATA_SOURCES)
def gsm8k_strict(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """The default GSM8K reward: strict extraction, 1.0 if right, else 0.0."""
    return compute_score(solution_str, ground_truth, method="strict")
