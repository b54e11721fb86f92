"""The demo task: single-digit addition answered in GSM8K's `#### <answer>` format.

A prompt is "3+4=" and a correct response is "#### 7" then EOS. The tokenizer is built in code (a
16-token word-level vocabulary), so the demo needs no downloads. Its reward is GSM8K's strict
scorer, registered for the data_source "arithmetic": 1.0 for the right number, else 0 (a format
bonus would also reinforce the wrong digits that come with the right format, and locks prompts onto
wrong answers early).
"""

from __future__ import annotations

import itertools
import os

import numpy as np

from jaxrl_llm.rewards.gsm8k import compute_score
from jaxrl_llm.rewards.registry import register_reward

DATA_SOURCE = "arithmetic"
SPECIAL = ["<pad>", "<eos>"]
WORDS = [str(d) for d in range(10)] + ["+", "=", "#### ", "-"]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_tokenizer(save_dir: str | None = None):
    """A `PreTrainedTokenizerFast`: <pad>=0, <eos>=1, digits, '+', '=', '#### ', '-'."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"#### |."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   chat_template=CHAT_TEMPLATE)
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        fast.save_pretrained(save_dir)
    return fast


@register_reward(DATA_SOURCE)
def arithmetic_score(solution_str, ground_truth, extra_info=None) -> float:
    """1.0 for the right `#### <n>`, else 0."""
    return compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0)


class ArithmeticDataset:
    """Every `a+b=` with 0 <= a, b <= max_operand, as PromptDataset-style items."""

    def __init__(self, tokenizer, *, max_operand: int = 9, split: str = "train"):
        pairs = list(itertools.product(range(max_operand + 1), repeat=2))
        self.items = []
        for i, (a, b) in enumerate(pairs):
            prompt = f"{a}+{b}="
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            self.items.append({"prompt_ids": list(ids), "raw_prompt": prompt, "data_source": DATA_SOURCE,
                               "ground_truth": str(a + b), "extra_info": {"split": split, "index": i},
                               "index": i})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def chance_reward(tokenizer, max_operand: int = 9, samples: int = 2000, max_new_tokens: int = 4,
                  seed: int = 0) -> float:
    """Mean reward of uniformly random responses: the 'chance' level of the demo."""
    rng = np.random.default_rng(seed)
    vocab = len(SPECIAL + WORDS)
    total = 0.0
    for _ in range(samples):
        a, b = rng.integers(0, max_operand + 1, size=2)
        ids = rng.integers(1, vocab, size=max_new_tokens).tolist()
        if 1 in ids:
            ids = ids[: ids.index(1)]
        total += arithmetic_score(tokenizer.decode(ids), str(a + b))
    return total / samples
