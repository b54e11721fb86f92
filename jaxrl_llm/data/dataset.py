"""`PromptDataset`: dataset rows -> chat-templated, tokenized prompts, with counted filters.

Like veRL's `RLHFDataset`: the message list goes through the tokenizer's chat template with
`add_generation_prompt=True`, and prompts longer than `max_prompt_length` tokens are filtered
(`filter_overlong_prompts`). Empty prompts, and GSM8K rows whose ground truth is not a number (they
could never score), are filtered too. Every filter is counted, exposed as an attribute, and reported
in one log line, so that a dataset that silently loses half its rows is noticed.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from jaxrl_llm.data.errors import DataError
from jaxrl_llm.data.sources import SourceRow, read_rows
from jaxrl_llm.rewards.gsm8k import DATA_SOURCES as GSM8K_DATA_SOURCES

log = logging.getLogger(__name__)

# A GSM8K ground truth must look like what the reward extracts from a response, or it never scores.
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def _is_empty(prompt) -> bool:
    if isinstance(prompt, str):
        return not prompt.strip()
    return not any(isinstance(m, dict) and str(m.get("content") or "").strip() for m in prompt)


def _check_messages(row: SourceRow, prompt_key: str) -> list[dict]:
    messages = row.data[prompt_key]
    if isinstance(messages, str):
        raise DataError(f"{row.where}: {prompt_key!r} is a string, but apply_chat_template=True needs a list "
                        "of messages; write it as [{\"role\": \"user\", \"content\": ...}] or pass "
                        "apply_chat_template=False")
    if not isinstance(messages, list | tuple) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{row.where}: {prompt_key!r} must be a list of messages "
                        "{\"role\": str, \"content\": str}; got " + repr(messages)[:200])
    # Parquet gives every message all the keys of any message (as nulls); the template wants them absent.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


class PromptDataset:
    """Tokenized prompts from veRL-schema parquet / jsonl files.

    Each item is a dict: `prompt_ids` (list[int]), `raw_prompt` (the templated text), `data_source`,
    `ground_truth`, `extra_info` (dict) and `index` (`extra_info["index"]`, else the item's position).

    Args:
      files: one or many .parquet / .jsonl paths.
      tokenizer: a HF tokenizer (with a chat template if `apply_chat_template`).
      max_prompt_length: the most prompt tokens; longer prompts are filtered (or, with
        `filter_overlong=False`, raise: veRL's `truncation="error"`).
      prompt_key: the column with the messages (veRL's `data.prompt_key`).
      apply_chat_template: template the message list; if False, `prompt_key` holds plain text.
      max_samples: keep only the first N rows (before filtering); None keeps all.
      tools: OpenAI function schemas for the chat template (`tools=`), for multi-turn rollouts; items
        then keep their `messages` and veRL's `agent_name` column, which the agent loop reads (an
        empty list: a multi-turn run without tools, whose rows play environments).

    Attributes:
      files: the files read, in order.
      num_rows_read, num_filtered_empty, num_filtered_ground_truth, num_filtered_overlong: counts.
    """

    def __init__(self, files, tokenizer, *, max_prompt_length: int, prompt_key: str = "prompt",
                 filter_overlong: bool = True, apply_chat_template: bool = True,
                 max_samples: int | None = None, tools: list[dict] | None = None):
        if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
            raise DataError(f"PromptDataset: max_prompt_length={max_prompt_length!r}; use a positive int")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(f"PromptDataset: the tokenizer ({getattr(tokenizer, 'name_or_path', tokenizer)}) "
                            "has no chat template; use an instruct/chat tokenizer or pass "
                            "apply_chat_template=False")
        rows = read_rows(files, prompt_key=prompt_key)
        if max_samples is not None:
            rows = rows[:max_samples]
        self.files = list(dict.fromkeys(row.file for row in rows))
        self.max_prompt_length = max_prompt_length
        self.num_rows_read = len(rows)
        first: dict[str, str] = {}  # filter -> where its first row was, for the log line

        kept: list[tuple[SourceRow, str]] = []
        self.num_filtered_empty = self.num_filtered_ground_truth = self.num_filtered_overlong = 0
        for row in rows:
            prompt = row.data[prompt_key]
            if not apply_chat_template and not isinstance(prompt, str):
                raise DataError(f"{row.where}: {prompt_key!r} must be a string when "
                                f"apply_chat_template=False; got a {type(prompt).__name__}")
            messages = _check_messages(row, prompt_key) if apply_chat_template else None
            if _is_empty(prompt):
                self.num_filtered_empty += 1
                first.setdefault("empty", row.where)
                continue
            ground_truth = row.data["reward_model"]["ground_truth"]
            if row.data["data_source"] in GSM8K_DATA_SOURCES and not _NUMBER_RE.fullmatch(str(ground_truth)):
                self.num_filtered_ground_truth += 1
                first.setdefault("ground_truth", f"{row.where}: {ground_truth!r}")
                continue
            kept.append((row, self._template(tokenizer, row, messages, tools) if messages is not None else prompt))

        ids = tokenizer([text for _, text in kept], add_special_tokens=False)["input_ids"] if kept else []
        self._items: list[dict[str, Any]] = []
        for (row, text), prompt_ids in zip(kept, ids):
            if len(prompt_ids) > max_prompt_length:
                if not filter_overlong:
                    raise DataError(f"{row.where}: the prompt has {len(prompt_ids)} tokens, more than "
                                    f"max_prompt_length={max_prompt_length}; raise max_prompt_length or set "
                                    "filter_overlong=True")
                self.num_filtered_overlong += 1
                first.setdefault("overlong", f"{row.where}: {len(prompt_ids)} tokens")
                continue
            extra_info = row.data.get("extra_info") or {}
            if not isinstance(extra_info, dict):
                raise DataError(f"{row.where}: 'extra_info' must be an object (dict) or absent; got "
                                f"{type(extra_info).__name__}")
            agent = {}
            if tools is not None:  # a multi-turn run's rows
                agent = {"messages": _check_messages(row, prompt_key) if apply_chat_template else
                         [{"role": "user", "content": text}], "agent_name": row.data.get("agent_name")}
            self._items.append({**agent,
                "prompt_ids": list(prompt_ids),
                "raw_prompt": text,
                "data_source": row.data["data_source"],
                "ground_truth": row.data["reward_model"]["ground_truth"],
                "extra_info": extra_info,
                "index": extra_info.get("index", len(self._items)),
            })
        self._log_summary(first)
        if not self._items:
            raise DataError(f"{', '.join(self.files)}: the dataset is empty after filtering: {self.num_rows_read} "
                            f"rows read, {self.num_filtered_empty} empty, {self.num_filtered_ground_truth} with a "
                            f"non-numeric gsm8k ground truth, {self.num_filtered_overlong} longer than "
                            f"{max_prompt_length} tokens; check the files, or raise max_prompt_length (gin: "
                            "data.max_prompt_length)")

    @staticmethod
    def _template(tokenizer, row: SourceRow, messages: list[dict], tools: list[dict] | None = None) -> str:
        try:
            return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                 tokenize=False)
        except Exception as e:
            raise DataError(f"{row.where}: the chat template failed on this prompt "
                            f"({type(e).__name__}: {e})") from None

    def _log_summary(self, first: dict[str, str]) -> None:
        def part(count: int, what: str, key: str) -> str:
            return f"{count} {what}" + (f" (first: {first[key]})" if key in first else "")

        log.info("PromptDataset %s: kept %d of %d rows; filtered %s, %s, %s", ", ".join(self.files),
                 len(self._items), self.num_rows_read,
                 part(self.num_filtered_empty, "empty prompts", "empty"),
                 part(self.num_filtered_ground_truth, "non-numeric gsm8k ground truths", "ground_truth"),
                 part(self.num_filtered_overlong, f"longer than {self.max_prompt_length} tokens", "overlong"))

    @property
    def filter_counts(self) -> dict[str, int]:
        """The filter counts by name, e.g. for metrics."""
        return {"empty": self.num_filtered_empty, "ground_truth": self.num_filtered_ground_truth,
                "overlong": self.num_filtered_overlong}

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._items[i]
