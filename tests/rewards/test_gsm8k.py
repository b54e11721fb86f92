"""GSM8K scoring: every real reference solution scores 1.0, plus veRL's edge cases by hand."""

import json

import pytest

from jaxrl_llm.rewards import compute_gsm8k_score, default_compute_score, extract_gsm8k_solution
from jaxrl_llm.rewards.gsm8k import SOLUTION_CLIP_CHARS


def _reference_answer(solution: str) -> str:
    return solution.rsplit("#### ", 1)[1].strip().replace(",", "")


@pytest.mark.parametrize("split", ["train", "test"])
@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_every_reference_solution_scores_one(gsm8k_dir, split, method):
    with open(gsm8k_dir / f"{split}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == {"train": 7473, "test": 1319}[split]
    failures = [i for i, row in enumerate(rows)
                if compute_gsm8k_score(row["answer"], _reference_answer(row["answer"]), method=method) != 1.0]
    assert failures == []


@pytest.mark.parametrize("response, strict, flexible", [
    ("so the answer is\n#### 72", "72", "72"),
    ("#### 1,234", "1234", "1234"),                           # commas stripped
    ("#### -5", "-5", "-5"),                                   # negative
    ("#### 2.50", "2.50", "2.50"),                             # decimal kept as written
    ("first #### 3 then #### 4", "4", "4"),                    # the last match wins
    ("#### $12", None, "12"),                                  # strict needs a digit right after '#### '
    ("she paid $1,000 in total.", None, "1000"),               # flexible: the last number, ',' dropped
    ("no numbers here", None, None),
    ("ends with a dot .", None, None),                         # '.' alone is not a number
    # veRL quirks, kept on purpose: a sentence-final '.' sticks to the number, and only '' and '.'
    # are skipped, so '...' counts as the last "number" for flexible.
    ("it costs 1,000.", None, "1000."),
    ("#### 7\nand then ...", "7", "..."),
    ("####72", None, "72"),                                    # strict needs the space
])
def test_extract_solution(response, strict, flexible):
    assert extract_gsm8k_solution(response, "strict") == strict
    assert extract_gsm8k_solution(response, "flexible") == flexible


def test_only_the_tail_is_searched():
    answer = "#### 42\n"
    filler = "x" * SOLUTION_CLIP_CHARS
    assert compute_gsm8k_score(answer + filler, "42") == 0.0                  # pushed out of the tail
    assert compute_gsm8k_score(filler + answer, "42") == 1.0
    assert compute_gsm8k_score(answer + filler[:-len(answer)], "42") == 1.0  # exactly 300 characters
    assert compute_gsm8k_score("#### 9 " + "1" * 400, "9", method="flexible") == 0.0


def test_score_values_follow_verl():
    assert compute_gsm8k_score("#### 5", "5", score=2.0) == 2.0
    assert compute_gsm8k_score("#### 6", "5", format_score=0.1) == 0.1      # answer found but wrong
    assert compute_gsm8k_score("nothing", "5", format_score=0.1) == 0.0     # no answer at all
    assert compute_gsm8k_score("#### 5", 5) == 1.0                          # an int truth compares as text
    assert compute_gsm8k_score("#### 5.0", "5") == 0.0                      # string comparison, as veRL
    with pytest.raises(ValueError, match="method='loose'"):
        extract_gsm8k_solution("#### 5", "loose")


def test_default_compute_score_dispatches_gsm8k_strict():
    for data_source in ("openai/gsm8k", "gsm8k"):
        assert default_compute_score(data_source, "#### 5", "5") == 1.0
        assert default_compute_score(data_source, "the answer is 5", "5") == 0.0    # strict, not flexible
        assert isinstance(default_compute_score(data_source, "#### 5", "5"), float)
