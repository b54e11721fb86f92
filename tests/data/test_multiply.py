"""The multiply demo's reward: 1.0 only for the right answer; partial credit for the call, the answer's
`#### ` and each digit in its place (below what the right answer gets); the tool's output cannot score;
each digit is one token."""

import pytest

from jaxrl_llm.data import multiply as m


@pytest.mark.parametrize("text, score", [
    (f"{m.CALL}\n#### 1776", 1.0),
    (f"{m.CALL}\n#### 1776=", 1.0),                    # what follows the number does not matter
    (f"{m.CALL}\n#### 17769", 0.2 + 0.1 + 0.6),         # every digit in its place, one too many
    (f"{m.CALL}\n#### 1076", 0.2 + 0.1 + 0.6 * 3 / 4),  # digits 1, 3, 4 right (each on its own)
    (f"{m.CALL}\n#### 9", 0.2 + 0.1),
    (f"{m.CALL}\n1776", 0.2),                           # no `#### `: no credit for the digits
    (f"{m.CALL}", 0.2),
    ("#### 1776", 1.0),                                 # the right answer without the tool still counts
    ("1776", 0.0),
])
def test_partial_credit(text, score):
    out = m.multiply_score(text, "37*48")
    assert out["score"] == pytest.approx(score)
    assert out["acc"] == float(score == 1.0) and out["called"] == float(text.startswith(m.CALL))


def test_one_token_per_digit_and_the_tool_output_in_the_same_layout_as_the_answer():
    tok = m.build_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    tool, answer = ids("<tool_response>1776</tool_response>"), ids("#### 1776<eos>")
    assert len(tool) == 6 and len(answer) == 6 and tool[1:5] == answer[1:5]
