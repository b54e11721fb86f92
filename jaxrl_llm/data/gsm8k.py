"""GSM8K in veRL's parquet schema: what `scripts/prepare_gsm8k.py` writes.

Same rows as veRL's `examples/data_preprocess/gsm8k.py`, so that parquet from either tool works with
either trainer: the question plus an instruction to end with `#### <answer>`, and the reference
answer's final number (commas removed) as the rule-based ground truth.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence

from jaxrl_llm.data.errors import DataError

log = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")

_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_NO_LOCAL_HINT = ("pass --local_dataset_path DIR, where DIR holds train.jsonl and test.jsonl "
                  "(GSM8K rows {\"question\", \"answer\"}, as in github.com/openai/grade-school-math)")


def extract_reference_answer(answer: str) -> str | None:
    """The number after `####` in a GSM8K reference solution, commas removed; None if absent."""
    match = _ANSWER_RE.search(answer)
    return match.group(1).replace(",", "") if match else None


def build_gsm8k_rows(examples: Iterable[dict], split: str, *, where: str = "") -> list[dict]:
    """veRL-schema rows from raw GSM8K examples `{"question", "answer"}`.

    Args:
      examples: raw rows, in order; `extra_info.index` is the position in this sequence.
      split: "train" or "test", stored in `extra_info.split`.
      where: the examples' origin, for error messages.
    """
    rows = []
    for index, example in enumerate(examples):
        question, answer = example.get("question"), example.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise DataError(f"GSM8K {split} {where} row {index}: needs string fields 'question' and "
                            f"'answer', got keys {sorted(example)}")
        ground_truth = extract_reference_answer(answer)
        if ground_truth is None:
            raise DataError(f"GSM8K {split} {where} row {index}: the answer has no '#### <number>' line; "
                            "is this the GSM8K 'main' config?")
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
        })
    return rows


def _read_local_split(local_dataset_path: str, split: str) -> tuple[list[dict], str]:
    """Raw examples of `split` from a directory: `<split>.jsonl`, or a hub snapshot's parquet."""
    jsonl = os.path.join(local_dataset_path, f"{split}.jsonl")
    if os.path.isfile(jsonl):
        with open(jsonl, encoding="utf-8") as f:
            try:
                return [json.loads(line) for line in f if line.strip()], jsonl
            except json.JSONDecodeError as e:
                raise DataError(f"{jsonl}: not valid JSON lines ({e})") from None
    # The layout of a downloaded hub snapshot of openai/gsm8k: main/<split>-00000-of-00001.parquet.
    shards = sorted(glob.glob(os.path.join(local_dataset_path, "main", f"{split}-*.parquet")))
    if shards:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return [row for shard in shards for row in pq.read_table(shard).to_pylist()], shards[0]
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{local_dataset_path}/main: cannot read the {split} parquet shards "
                            f"({type(e).__name__}: {e})") from None
    raise DataError(f"{local_dataset_path}: no {split}.jsonl (nor a hub snapshot's main/{split}-*.parquet); "
                    + _NO_LOCAL_HINT)


def _read_hub_split(split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DataError("the `datasets` package is not installed, so openai/gsm8k cannot be loaded from "
                        "the hub; " + _NO_LOCAL_HINT) from None
    try:
        return list(datasets.load_dataset(DATA_SOURCE, "main", split=split))
    except Exception as e:
        raise DataError(f"could not load {DATA_SOURCE} from the hub ({type(e).__name__}: {e}); offline? "
                        + _NO_LOCAL_HINT) from None


def load_gsm8k_rows(split: str, local_dataset_path: str | None = None) -> list[dict]:
    """veRL-schema rows of one GSM8K split, from a local directory or (if None) the hub."""
    if split not in SPLITS:
        raise DataError(f"GSM8K split {split!r}: use one of {SPLITS}")
    if local_dataset_path is None:
        return build_gsm8k_rows(_read_hub_split(split), split, where=f"({DATA_SOURCE} on the hub)")
    local_dataset_path = os.path.expanduser(local_dataset_path)
    if not os.path.isdir(local_dataset_path):
        raise DataError(f"--local_dataset_path {local_dataset_path}: not a directory; " + _NO_LOCAL_HINT)
    examples, where = _read_local_split(local_dataset_path, split)
    return build_gsm8k_rows(examples, split, where=f"({where})")


def write_gsm8k_parquet(local_save_dir: str, local_dataset_path: str | None = None,
                        splits: Sequence[str] = SPLITS, *, row_fn: Callable[[dict], dict] | None = None,
                        max_rows: int | None = None, what: str = "GSM8K") -> dict[str, str]:
    """Writes `<split>.parquet` for each split into `local_save_dir`; returns split -> path. `row_fn` turns
    each veRL-schema row into another schema (the multi-turn tool rows); `max_rows` keeps the first rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    local_save_dir = os.path.expanduser(local_save_dir)
    os.makedirs(local_save_dir, exist_ok=True)
    paths = {}
    for split in splits:
        rows = load_gsm8k_rows(split, local_dataset_path)[:max_rows]
        if row_fn is not None:
            rows = [row_fn(r) for r in rows]
        path = os.path.join(local_save_dir, f"{split}.parquet")
        # Written beside and renamed, so a crash never leaves a half-written file for the trainer.
        tmp = path + ".tmp"
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
        log.info("wrote %d %s %s rows to %s", len(rows), what, split, path)
        paths[split] = path
    return paths


def prepare_main(argv: list[str] | None, *, prog: str, description: str, default_save_dir: str,
                 row_fn: Callable[[dict], dict] | None = None, max_rows_flag: bool = False,
                 what: str = "GSM8K") -> int:
    """The command line of the GSM8K prep scripts (veRL's flags); 2 and one line on stderr for bad input."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--local_dataset_path", default=None,
                        help="directory with GSM8K train.jsonl/test.jsonl; default: the hub's openai/gsm8k")
    parser.add_argument("--local_save_dir", default=default_save_dir, help="where to write the parquet files")
    parser.add_argument("--local_dir", default=None, help="deprecated (veRL's old name for --local_save_dir)")
    if max_rows_flag:
        parser.add_argument("--max_rows", type=int, default=None, help="keep the first N rows of each split")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    save_dir = args.local_save_dir
    if args.local_dir is not None:
        logging.warning("--local_dir is deprecated; use --local_save_dir")
        save_dir = args.local_dir
    max_rows = getattr(args, "max_rows", None)
    if max_rows is not None and max_rows < 1:
        print(f"{prog}: error: --max_rows {max_rows}: use a positive number", file=sys.stderr)
        return 2
    try:
        write_gsm8k_parquet(save_dir, args.local_dataset_path, row_fn=row_fn, max_rows=max_rows, what=what)
    except DataError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
