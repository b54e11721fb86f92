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

import sys

from jaxrl_llm.data.gsm8k import prepare_main, write_gsm8k_parquet

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
    return write_gsm8k_parquet(local_save_dir, local_dataset_path, splits, row_fn=to_multiturn_row,
                               max_rows=max_rows, what="GSM8K multi-turn")


def main(argv: list[str] | None = None) -> int:
    return prepare_main(argv, prog="prepare_gsm8k_multiturn", description=__doc__.splitlines()[0],
                        default_save_dir="~/data/gsm8k_multiturn", row_fn=to_multiturn_row, max_rows_flag=True,
                        what="GSM8K multi-turn")


if __name__ == "__main__":
    sys.exit(main())
