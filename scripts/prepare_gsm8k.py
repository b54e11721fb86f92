"""Writes GSM8K as veRL-schema `train.parquet` / `test.parquet` (see `jaxrl_llm.data.gsm8k`).

    python scripts/prepare_gsm8k.py --local_dataset_path /work/shared/data/gsm8k --local_save_dir ~/data/gsm8k

Without --local_dataset_path it loads `openai/gsm8k` from the hub (needs the `datasets` package).
"""

from __future__ import annotations

import sys

from jaxrl_llm.data.gsm8k import prepare_main


def main(argv: list[str] | None = None) -> int:
    return prepare_main(argv, prog="prepare_gsm8k", description=__doc__.splitlines()[0],
                        default_save_dir="~/data/gsm8k")


if __name__ == "__main__":
    sys.exit(main())
