"""The agentic demo task: two-digit multiplication that a tiny model can only answer through a tool.

A prompt is "37*48=" (operands 32..99, so every product has four digits). The model has a `multiply`
tool (hermes format) that multiplies the question's numbers: its per-row state comes from the row's
`extra_info.tools_kwargs.multiply.create_kwargs` (veRL's per-row tool arguments), so a call takes no
arguments. A correct response is one call, then the answer copied from the tool's output:

    <tool_call>{"name": "multiply", "arguments": {}}</tool_call><eos>   (assistant)
    <tool_response>1776</tool_response>                                 (tool turn, mask 0)
    #### 1776<eos>                                                      (assistant)

The tokenizer is built in code (a word-level vocabulary, the call one word, each digit one token), so
the demo needs no downloads, and a randomly initialised model can stumble on the call. The reward reads
the assistant's text only (the tool's output cannot score by itself): 1.0 for the right `#### <product>`.
A wrong answer gets partial credit: 0.2 for the call turn, then, for an answer turn that starts with
`#### `, 0.1 plus 0.6 times the share of the product's digits it has right, each digit on its own (digit
i against digit i). Scoring the digits one by one, rather than only a right start, gives every answer
four chances to be rewarded for a copied digit, and the copy (an attention head that reads the tool's
digit at a fixed distance back: the tool's output and the answer are laid out the same way in every
response) is one skill for all four positions; see benchmarks/NOTES.md for what did not work.
"""

from __future__ import annotations

import itertools
import os
import re

import numpy as np

from jaxrl_llm.agent.tools import BaseTool
from jaxrl_llm.rewards.gsm8k import compute_score
from jaxrl_llm.rewards.registry import register_reward

DATA_SOURCE = "multiply"
SPECIAL = ["<pad>", "<eos>", "<unk>"]
ANSWER = "#### "
CALL = '<tool_call>{"name": "multiply", "arguments": {}}</tool_call>'
WORDS = [str(d) for d in range(10)] + ["*", "=", "#### ", CALL, "<tool_response>", "</tool_response>"]
# The assistant's turns end with <eos>; a tool turn is its <tool_response> block; no headers.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<eos>"
                 "{% elif m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
                 "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
_LONG_WORDS = "|".join(re.escape(w) for w in sorted(WORDS, key=len, reverse=True) if len(w) > 1)


def build_tokenizer(save_dir: str | None = None):
    """A `PreTrainedTokenizerFast`: <pad>=0, <eos>=1, <unk>=2, digits, '*', '=', '#### ', the call and the
    tool response's two tags."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{_LONG_WORDS}|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        fast.save_pretrained(save_dir)
    return fast


def vocab_size() -> int:
    return len(SPECIAL) + len(WORDS)


@register_reward(DATA_SOURCE)
def multiply_score(solution_str, ground_truth, extra_info=None) -> dict:
    """1.0 for the right `#### <product>`; otherwise partial credit (at most 0.9) for the call turn, then
    the answer's start and its digits (see the module docstring). `acc` is the answer's correctness alone
    (the demo's accuracy), `called` whether the first turn is exactly the call."""
    a, b = (int(x) for x in ground_truth.split("*"))
    acc = compute_score(solution_str, str(a * b), method="strict", format_score=0.0, score=1.0)
    turns = solution_str.split("\n")
    called = turns[0] == CALL
    shaped = 0.2 * called
    if called and len(turns) > 1 and turns[1].startswith(ANSWER):
        got, want = turns[1][len(ANSWER):], str(a * b)
        shaped += 0.1 + 0.6 * sum(g == w for g, w in zip(got, want)) / len(want)
    return {"score": max(acc, shaped), "acc": acc, "called": float(called)}


class MultiplyTool(BaseTool):
    """`multiply` with no arguments: the product of the row's two numbers, given per row by veRL's
    `extra_info.tools_kwargs.multiply.create_kwargs` ({"a": 37, "b": 48})."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema or {"type": "function", "function": {
            "name": "multiply", "description": "Multiplies the two numbers of the question.",
            "parameters": {"type": "object", "properties": {}}}})
        self._rows: dict[str, tuple[int, int]] = {}

    def create(self, instance_id: str | None = None, a: int = 0, b: int = 0, **kwargs) -> str:
        self._rows[instance_id] = (int(a), int(b))
        return instance_id

    def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[str, float, dict]:
        a, b = self._rows[instance_id]
        return str(a * b), 0.0, {}

    def release(self, instance_id: str, **kwargs) -> None:
        self._rows.pop(instance_id, None)


class MultiplyDataset:
    """Every `a*b=` with a, b in [low, high], as PromptDataset-style items (with `messages`); the train
    split holds one in `holdout` pairs less than all, the test split those held out."""

    def __init__(self, tokenizer, *, low: int = 32, high: int = 99, split: str = "train", holdout: int = 10,
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
            tools_kwargs = {"multiply": {"create_kwargs": {"a": a, "b": b}}}
            self.items.append({"prompt_ids": list(ids), "raw_prompt": text, "messages": messages,
                               "data_source": DATA_SOURCE, "ground_truth": f"{a}*{b}",
                               "extra_info": {"split": split, "index": i, "tools_kwargs": tools_kwargs}, "index": i})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]
