"""Reads prompt rows from veRL-schema parquet files (as written by veRL's preprocessing scripts and by
`scripts/prepare_gsm8k.py`) and from jsonl files with the same fields.

A row has at least `data_source`, `prompt` (a list of chat messages) and `reward_model.ground_truth`;
`ability` and `extra_info` are optional. Rows come back as `SourceRow`s that remember where they came
from, so that later errors can name the file and the row.

jaxrl_llm trains language models only (of a Qwen3.5 vision-language checkpoint, the language model): a row
that carries images or videos (veRL's `images`, `videos`, `multi_modal_data` columns, or a chat message
with image or video content parts) is one `DataError` naming the field, not a prompt trained without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from jaxrl_llm.data.errors import DataError

SUFFIXES = (".parquet", ".jsonl")


@dataclasses.dataclass(frozen=True)
class SourceRow:
    """One dataset row (`data`, as read) and where it is: `file` and its 0-based `row` there."""

    file: str
    row: int
    data: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.file} row {self.row}"


def _as_file_list(files) -> list[str]:
    if isinstance(files, str | os.PathLike):
        files = [files]
    if not isinstance(files, Sequence) or not files:
        raise DataError(f"no dataset files given ({files!r}); pass a .parquet or .jsonl path, or a list "
                        "of them")
    return [os.path.expanduser(os.fspath(f)) for f in files]


def _read_parquet(path: str, prompt_key: str) -> list[dict]:
    import pyarrow as pa  # only parquet needs it; jsonl datasets work without pyarrow
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read it as parquet ({type(e).__name__}: {e}); the file is corrupt "
                        "or not parquet: write it again") from None
    for field in ("data_source", prompt_key, "reward_model"):
        if field not in schema.names:
            raise DataError(f"{path}: no column {field!r} (columns: {schema.names}); every row needs "
                            f"'data_source', {prompt_key!r} and 'reward_model.ground_truth' (veRL schema)")
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read its rows ({type(e).__name__}: {e}); the file is corrupt: "
                        "write it again") from None


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {line_no}: not valid JSON ({e}); each line must be one "
                                    "JSON object") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path} line {line_no}: a {type(row).__name__}, not a JSON object; each "
                                    "line must be one object with data_source, prompt and reward_model")
                rows.append(row)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read it ({type(e).__name__}: {e})") from None
    return rows


def _missing_field(row: dict, prompt_key: str) -> str | None:
    """The first required field that `row` lacks (or holds as null), or None."""
    if not isinstance(row.get("data_source"), str) or not row["data_source"]:
        return "data_source"
    if row.get(prompt_key) is None:
        return prompt_key
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        return "reward_model.ground_truth"
    return None


# veRL's columns for a multimodal row (`RLHFDataset`'s image_key / video_key, and what it builds from them).
MULTIMODAL_COLUMNS = ("images", "videos", "multi_modal_data", "multi_modal_inputs")
# Content-part types of a chat message that carry an image or a video (HF's and OpenAI's chat formats).
_MEDIA_PARTS = ("image", "image_url", "input_image", "video", "video_url")


def _multimodal_field(row: dict, prompt_key: str) -> str | None:
    """The first field of `row` that carries images or videos, or None."""
    for column in MULTIMODAL_COLUMNS:
        if row.get(column) not in (None, [], {}, ""):
            return column
    messages = row.get(prompt_key)
    if isinstance(messages, list | tuple):
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list | tuple) and any(
                    isinstance(part, dict) and (part.get("type") in _MEDIA_PARTS or any(
                        part.get(k) is not None for k in _MEDIA_PARTS)) for part in content):
                return f"{prompt_key}[{i}].content"
    return None


def read_file(path: str, *, prompt_key: str = "prompt") -> list[SourceRow]:
    """The rows of one .parquet or .jsonl file, checked for the required fields."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such dataset file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory; pass the .parquet or .jsonl files in it")
    if path.endswith(".parquet"):
        rows = _read_parquet(path, prompt_key)
    elif path.endswith(".jsonl"):
        rows = _read_jsonl(path)
    else:
        raise DataError(f"{path}: unknown file type; dataset files must end in one of {SUFFIXES}")
    bad = [(i, field) for i, row in enumerate(rows) if (field := _missing_field(row, prompt_key))]
    if bad:
        i, field = bad[0]
        more = f" ({len(bad) - 1} more rows lack a required field)" if len(bad) > 1 else ""
        raise DataError(f"{path} row {i}: field {field!r} is missing or null{more}; every row needs "
                        f"'data_source' (a non-empty string), {prompt_key!r} and 'reward_model.ground_truth'")
    media = [(i, field) for i, row in enumerate(rows) if (field := _multimodal_field(row, prompt_key))]
    if media:
        i, field = media[0]
        more = f" ({len(media) - 1} more rows carry images or videos)" if len(media) > 1 else ""
        raise DataError(f"{path} row {i}: {field!r} carries images or videos{more}; jaxrl_llm trains the language "
                        "model only (a vision-language checkpoint's vision tower is not loaded): drop the rows with "
                        "images or videos, or the column")
    return [SourceRow(path, i, row) for i, row in enumerate(rows)]


def read_rows(files, *, prompt_key: str = "prompt") -> list[SourceRow]:
    """The rows of one or many .parquet / .jsonl files, in order; one clear `DataError` if unusable.

    Args:
      files: a path or a list of paths.
      prompt_key: the column that holds the chat messages (veRL's `data.prompt_key`).
    """
    paths = _as_file_list(files)
    rows = [row for path in paths for row in read_file(path, prompt_key=prompt_key)]
    if not rows:
        raise DataError(f"the dataset is empty: no rows in {paths}")
    return rows
