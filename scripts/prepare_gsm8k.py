"""Writes GSM8K as veRL-schema `train.parquet` / `test.parquet` (see `jaxrl_llm.data.gsm8k`).

    python scripts/prepare_gsm8k.py --local_dataset_path /work/shared/data/gsm8k --local_save_dir ~/data/gsm8k

Without --local_dataset_path it loads `openai/gsm8k` from the hub (needs the `datasets` package).
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxrl_llm.data import DataError, write_gsm8k_parquet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_dataset_path", default=None,
                        help="directory with GSM8K train.jsonl/test.jsonl; default: the hub's openai/gsm8k")
    parser.add_argument("--local_save_dir", default="~/data/gsm8k", help="where to write the parquet files")
    parser.add_argument("--local_dir", default=None, help="deprecated (veRL's old name for --local_save_dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    save_dir = args.local_save_dir
    if args.local_dir is not None:
        logging.warning("--local_dir is deprecated; use --local_save_dir")
        save_dir = args.local_dir
    try:
        write_gsm8k_parquet(save_dir, args.local_dataset_path)
    except DataError as e:
        print(f"prepare_gsm8k: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
