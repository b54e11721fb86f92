"""python -m jaxrl_llm.bench.table --section S --cols A,B,... FILE...: the rows of section S in bench result files
(bench.json or rows.jsonl) as one markdown table of the chosen columns, a row per result, the file's name first
(what a GPU session prints at its end to compare its runs)."""

from __future__ import annotations

import argparse
import json
import os


def read_rows(path: str) -> list[dict]:
    """The result rows of a bench.json ({"meta", "results"}) or a rows.jsonl."""
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)["results"]


def table(paths: list[str], section: str, cols: list[str]) -> str:
    lines = ["| run | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for path in paths:
        name = os.path.basename(path).split(".")[0]
        for row in read_rows(path):
            if row.get("section") == section:
                cells = [row.get(c, "") for c in cols]
                lines.append(f"| {name} | " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v)
                                                           for v in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_llm.bench.table", description=__doc__)
    ap.add_argument("--section", required=True)
    ap.add_argument("--cols", required=True, help="comma-separated row keys")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    print(table([p for p in args.files if os.path.exists(p)], args.section, args.cols.split(",")))


if __name__ == "__main__":
    main()
