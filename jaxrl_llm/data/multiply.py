"""The agentic demo task: two-digit multiplication that a tiny model can only answer through a tool.

A prompt is "37*48=". The model has a `multiply` tool (hermes format). A correct response is one call,
then the answer copied from the tool's output:

    <tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 48}}</tool_call><eos>   (assistant)
    <tool_response>1776</tool_response>                                               (tool turn)
    #### 1776<eos>                                                                    (assistant)

The tokenizer is built in code (a word-level vocabulary), so the demo needs no downloads. The call's
fixed text is three words (`<tool_call>{"name": "multiply", "arguments": {"a": `, `, "b": ` and
`}}</tool_call>`), so a randomly initialised model can stumble on a call and learn to copy the digits.
The reward reads the assistant's text only (the tool's output cannot score by itself): 1.0 for the
right `#### <product>`; a wrong answer gets partial credit for a well-formed call (0.1) and for each of
the call's operands copied right (0.2 each), which makes the first steps of exploration reachable.
"""

from __future__ import annotations

import itertools
import os
import re

import numpy as np

from jaxrl_llm.rewards.gsm8k import compute_score
from jaxrl_llm.rewards.registry import register_reward

DATA_SOURCE = "multiply"
SPECIAL = ["<pad>", "<eos>"]
CALL_OPEN = '<tool_call>{"name": "multiply", "arguments": {"a": '
CALL_MID = ', "b": '
CALL_CLOSE = "}}</tool_call>"
WORDS = [str(d) for d in range(10)] + ["*", "=", "#### ", CALL_OPEN, CALL_MID, CALL_CLOSE, "<tool_response>",
                                       "</tool_response>"]
# The assistant's turns end with <eos>; a tool turn is its <tool_response> block; no headers.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<eos>"
                 "{% elif m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
                 "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
_CALL_RE = re.compile(r'"a": (\d+), "b": (\d+)\}\}')


def build_tokenizer(save_dir: str | None = None):
    """A `PreTrainedTokenizerFast`: <pad>=0, <eos>=1, digits, '*', '=', '#### ', the call's three words and
    the tool response's two tags."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    long_words = "|".join(re.escape(w) for w in sorted(WORDS, key=len, reverse=True) if len(w) > 1)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{long_words}|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   chat_template=CHAT_TEMPLATE)
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        fast.save_pretrained(save_dir)
    return fast


def vocab_size() -> int:
    return len(SPECIAL) + len(WORDS)


@register_reward(DATA_SOURCE)
def multiply_score(solution_str, ground_truth, extra_info=None) -> dict:
    """1.0 for the right `#### <product>`; otherwise 0.1 for a call and 0.2 for each operand copied right.
    `acc` is the answer's correctness alone (the demo's accuracy)."""
    a, b = (int(x) for x in ground_truth.split("*"))
    acc = compute_score(solution_str, str(a * b), method="strict", format_score=0.0, score=1.0)
    shaped = 0.0
    call = _CALL_RE.search(solution_str)
    if call is not None:
        shaped = 0.1 + 0.2 * (int(call.group(1)) == a) + 0.2 * (int(call.group(2)) == b)
    return {"score": max(acc, shaped), "acc": acc, "called": float(call is not None)}


class MultiplyDataset:
    """Every `a*b=` with a, b in [low, high], as PromptDataset-style items (with `messages`); the train
    split holds one in `holdout` pairs less than all, the test split those held out."""

    def __init__(self, tokenizer, *, low: int = 10, high: int = 99, split: str = "train", holdout: int = 10,
                 seed: int = 0):
        pairs = list(itertools.product(range(low, high + 1), repeat=2))
        test = np.random.default_rng(seed).random(len(pairs)) < 1.0 / holdout
        self.items = []
        for i, (a, b) in enumerate(pairs):
            if test[i] != (split == "test"):
                continue
            messages = [{"role": "user", "content": f"{a}*{b}="}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            self.items.append({"prompt_ids": list(ids), "raw_prompt": text, "messages": messages,
                               "data_source": DATA_SOURCE, "ground_truth": f"{a}*{b}",
                               "extra_info": {"split": split, "index": i}, "index": i})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]
