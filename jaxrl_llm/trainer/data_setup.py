"""Tokenizer, datasets and the resumable prompt iterator of a run."""

from __future__ import annotations

import logging
import os

from jaxrl_llm.data import PromptDataset, PromptIterator
from jaxrl_llm.trainer.config import ConfigValueError, RunConfig

log = logging.getLogger(__name__)


def load_tokenizer(run: RunConfig):
    """The demo's built-in tokenizer, or a HF tokenizer from `tokenizer_path` (default: the model path)."""
    if run.data.source in ("arithmetic", "multiply"):
        from jaxrl_llm.data import arithmetic, multiply

        return (arithmetic if run.data.source == "arithmetic" else multiply).build_tokenizer()
    import transformers

    path = run.model.tokenizer_path or run.model.path
    if path is None:
        raise ConfigValueError("model.tokenizer_path: a random-init preset needs a tokenizer; set "
                         "model.tokenizer_path to a HF tokenizer dir (e.g. ../shared/data/qwen2_tokenizer)")
    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigValueError(f"model.tokenizer_path: cannot load a tokenizer from {path!r} ({e})") from None


def build_datasets(run: RunConfig, tokenizer, tools: list[dict] | None = None):
    """(train dataset, val dataset or None, PromptIterator over train); `tools` are the tool schemas the
    chat template shows a multi-turn run's prompts."""
    d = run.data
    if d.source == "multiply":
        from jaxrl_llm.data.multiply import MultiplyDataset

        train = MultiplyDataset(tokenizer, split="train")
        val = MultiplyDataset(tokenizer, split="test")
    elif d.source == "arithmetic":
        from jaxrl_llm.data.arithmetic import ArithmeticDataset

        train = ArithmeticDataset(tokenizer, max_operand=d.arithmetic_max_operand, split="train")
        val = ArithmeticDataset(tokenizer, max_operand=d.arithmetic_max_operand, split="test")
    else:
        expand = lambda files: [os.path.expanduser(f) for f in files]
        train = PromptDataset(expand(d.train_files), tokenizer, max_prompt_length=d.max_prompt_length,
                              prompt_key=d.prompt_key, tools=tools)
        val = (PromptDataset(expand(d.val_files), tokenizer, max_prompt_length=d.max_prompt_length,
                             prompt_key=d.prompt_key, max_samples=d.val_max_samples, tools=tools)
               if d.val_files else None)
    iterator = PromptIterator(train, d.train_batch_size, seed=d.seed, shuffle=d.shuffle)
    return train, val, iterator
