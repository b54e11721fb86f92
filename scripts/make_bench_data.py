"""Builds `.bench_data/`, the data the GPU benchmarks read (the lent GPU machines see only the repo).

    python scripts/make_bench_data.py [--shared ../shared/data] [--out .bench_data]

It holds the Qwen2 tokenizer and GSM8K's test split as veRL-schema jsonl (`gsm8k_test.jsonl`); name it in
the device tool's `carry`. `.bench_data/` is ignored by git.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from jaxrl_llm.data.gsm8k import load_gsm8k_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=os.path.join(REPO, "..", "shared", "data"))
    ap.add_argument("--out", default=os.path.join(REPO, ".bench_data"))
    args = ap.parse_args(argv)
    tok_src = os.path.join(args.shared, "qwen2_tokenizer")
    if not os.path.isdir(tok_src):
        print(f"make_bench_data: error: no tokenizer at {tok_src}; pass --shared DIR", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    shutil.copytree(tok_src, os.path.join(args.out, "qwen2_tokenizer"), dirs_exist_ok=True)
    rows = load_gsm8k_rows("test", os.path.join(args.shared, "gsm8k"))
    with open(os.path.join(args.out, "gsm8k_test.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} prompts and the tokenizer to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
