"""PromptDataset: chat templating with the real Qwen2 tokenizer, and counted, logged filters."""

import logging
import types

import pytest

from jaxrl_llm.data import DataError, PromptDataset
from tests.data.test_sources import row, write_jsonl, write_parquet


def build(tmp_path, rows, tokenizer, fmt="jsonl", **kwargs):
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"d.{fmt}", rows)
    kwargs.setdefault("max_prompt_length", 64)
    return PromptDataset(path, tokenizer, **kwargs), path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_filters_are_counted_and_logged(tmp_path, qwen2_tokenizer, caplog, fmt):
    rows = [
        row("What is 1+1?", "2"),
        row("word " * 100, "3"),                                       # overlong
        {**row(), "prompt": []},                                       # empty
        row("   ", "4"),                                               # empty content
        row("What is 2+2?", "four"),                                   # non-numeric gsm8k ground truth
        row("What is 3+3?", "1,000"),                                  # a formatted number never matches
        row("Name a colour.", "blue", data_source="my/colours"),      # other data sources keep any truth
        row("What is 1.5*2?", "-3.0"),
    ]
    with caplog.at_level(logging.INFO, logger="jaxrl_llm.data.dataset"):
        ds, path = build(tmp_path, rows, qwen2_tokenizer, fmt)
    assert len(ds) == 3 and [it["ground_truth"] for it in ds] == ["2", "blue", "-3.0"]
    assert (ds.num_rows_read, ds.num_filtered_overlong, ds.num_filtered_empty, ds.num_filtered_ground_truth) \
        == (8, 1, 2, 2)
    assert ds.filter_counts == {"empty": 2, "ground_truth": 2, "overlong": 1}
    [line] = [r.getMessage() for r in caplog.records]
    assert "kept 3 of 8 rows" in line
    assert f"2 empty prompts (first: {path} row 2)" in line
    assert f"2 non-numeric gsm8k ground truths (first: {path} row 4: 'four')" in line
    assert f"1 longer than 64 tokens (first: {path} row 1: " in line


def test_item_fields(tmp_path, qwen2_tokenizer):
    rows = [{**row("Hi?", "1"), "extra_info": {"index": 41, "split": "train"}},
            {**row("Yo?", "2"), "extra_info": None}]
    ds, _ = build(tmp_path, rows, qwen2_tokenizer)
    first, second = ds[0], ds[1]
    assert set(first) == {"prompt_ids", "raw_prompt", "data_source", "ground_truth", "extra_info", "index"}
    assert first["raw_prompt"] == ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
                                   "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    assert qwen2_tokenizer.decode(first["prompt_ids"]) == first["raw_prompt"]
    assert (first["index"], first["extra_info"]) == (41, {"index": 41, "split": "train"})
    assert (second["index"], second["extra_info"]) == (1, {})       # no extra_info: the position


def test_length_limit_is_inclusive_and_non_filtering_mode_raises(tmp_path, qwen2_tokenizer):
    ds, _ = build(tmp_path, [row("What is 1+1?")], qwen2_tokenizer, max_prompt_length=1000)
    n = len(ds[0]["prompt_ids"])
    assert len(build(tmp_path, [row("What is 1+1?")], qwen2_tokenizer, max_prompt_length=n)[0]) == 1
    message = rf"row 0: the prompt has {n} tokens, more than max_prompt_length={n - 1}"
    with pytest.raises(DataError, match=message):
        build(tmp_path, [row("What is 1+1?")], qwen2_tokenizer, max_prompt_length=n - 1,
              filter_overlong=False)


def test_everything_filtered_is_an_error(tmp_path, qwen2_tokenizer):
    with pytest.raises(DataError, match=r"empty after filtering: 2 rows read, 1 empty, 0 .* 1 longer than 8"):
        build(tmp_path, [row(""), row("a long question " * 5)], qwen2_tokenizer, max_prompt_length=8)


def test_plain_text_prompts_without_chat_template(tmp_path, qwen2_tokenizer):
    rows = [{**row(), "prompt": "Question: 1+1?\nAnswer:"}]
    ds, _ = build(tmp_path, rows, qwen2_tokenizer, apply_chat_template=False)
    assert ds[0]["raw_prompt"] == "Question: 1+1?\nAnswer:"
    assert ds[0]["prompt_ids"] == qwen2_tokenizer("Question: 1+1?\nAnswer:")["input_ids"]
    with pytest.raises(DataError, match=r"row 0: 'prompt' is a string, but apply_chat_template=True"):
        build(tmp_path, rows, qwen2_tokenizer)
    with pytest.raises(DataError, match="must be a string when apply_chat_template=False; got a list"):
        build(tmp_path, [row()], qwen2_tokenizer, apply_chat_template=False)


def test_prompt_key_and_bad_messages(tmp_path, qwen2_tokenizer):
    rows = [{**row(), "question": [{"role": "user", "content": "Other column?"}]}]
    ds, _ = build(tmp_path, rows, qwen2_tokenizer, prompt_key="question")
    assert "Other column?" in ds[0]["raw_prompt"]
    with pytest.raises(DataError, match=r"row 0: 'prompt' must be a list of messages"):
        build(tmp_path, [{**row(), "prompt": [{"content": "no role"}]}], qwen2_tokenizer)
    with pytest.raises(DataError, match=r"row 0: 'extra_info' must be an object \(dict\) or absent; got str"):
        build(tmp_path, [{**row(), "extra_info": "note"}], qwen2_tokenizer)


def test_setup_errors(tmp_path, qwen2_tokenizer):
    no_template = types.SimpleNamespace(chat_template=None, name_or_path="base-model")
    with pytest.raises(DataError, match=r"\(base-model\) has no chat template"):
        build(tmp_path, [row()], no_template)
    with pytest.raises(DataError, match="max_prompt_length=0"):
        build(tmp_path, [row()], qwen2_tokenizer, max_prompt_length=0)
