"""Writes GSM8K for tool-calling RL: `train.parquet` / `test.parquet` in the schema of veRL's
multi-turn example (`examples/data_preprocess/gsm8k_multiturn_w_tool.py`), for the
`calc_gsm8k_reward` tool (`gin/tools/gsm8k_tool_config.yaml`).

    python scripts/prepare_gsm8k_multiturn.py --local_dataset_path /work/shared/data/gsm8k \
        --local_save_dir ~/data/gsm8k_multiturn

Each row: a system prompt telling the model to use the tool, the question with the `####` instruction,
`reward_model.ground_truth`, `agent_name: tool_agent`, and `extra_info.tools_kwargs.calc_gsm8k_reward.
create_kwargs.ground_truth` (the tool scores submitted answers against it). Without
--local_dataset_path it loads `openai/gsm8k` from the hub (needs the `datasets` package).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxrl_llm.data import DataError, load_gsm8k_rows

TOOL_NAME = "calc_gsm8k_reward"
AGENT_NAME = "tool_agent"
# veRL's system prompt for this example, so that runs of either trainer see the same prompt.
SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. "
    f"You should use the `{TOOL_NAME}` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. "
    "Put your final answer in the format of `#### <answer>`.")


def to_multiturn_row(row: dict) -> dict:
    """A single-turn GSM8K row (`jaxrl_llm.data.gsm8k`) as a tool-calling row."""
    ground_truth = row["reward_model"]["ground_truth"]
    return {
        "data_source": row["data_source"],
        "agent_name": AGENT_NAME,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, *row["prompt"]],
        "ability": row["ability"],
        "reward_model": row["reward_model"],
        "extra_info": {
            **row["extra_info"],
            "need_tools_kwargs": True,
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}},
        },
    }


def write_gsm8k_multiturn_parquet(local_save_dir: str, local_dataset_path: str | None = None,
                                  splits: tuple[str, ...] = ("train", "test"),
                                  max_rows: int | None = None) -> dict[str, str]:
    """Writes `<split>.parquet` for each split; returns split -> path. `max_rows` keeps the first rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    local_save_dir = os.path.expanduser(local_save_dir)
    os.makedirs(local_save_dir, exist_ok=True)
    paths = {}
    for split in splits:
        rows = [to_multiturn_row(r) for r in load_gsm8k_rows(split, local_dataset_path)[:max_rows]]
        path = os.path.join(local_save_dir, f"{split}.parquet")
        tmp = path + ".tmp"  # renamed into place: a crash never leaves a half-written file
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
        logging.info("wrote %d GSM8K multi-turn %s rows to %s", len(rows), split, path)
        paths[split] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_dataset_path", default=None,
                        help="directory with GSM8K train.jsonl/test.jsonl; default: the hub's openai/gsm8k")
    parser.add_argument("--local_save_dir", default="~/data/gsm8k_multiturn", help="where to write the parquet")
    parser.add_argument("--local_dir", default=None, help="deprecated (veRL's old name for --local_save_dir)")
    parser.add_argument("--max_rows", type=int, default=None, help="keep the first N rows of each split")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    save_dir = args.local_save_dir
    if args.local_dir is not None:
        logging.warning("--local_dir is deprecated; use --local_save_dir")
        save_dir = args.local_dir
    if args.max_rows is not None and args.max_rows < 1:
        print(f"prepare_gsm8k_multiturn: error: --max_rows {args.max_rows}: use a positive number", file=sys.stderr)
        return 2
    try:
        write_gsm8k_multiturn_parquet(save_dir, args.local_dataset_path, max_rows=args.max_rows)
    except DataError as e:
        print(f"prepare_gsm8k_multiturn: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
