"""The session summary table: a section's rows from bench.json and rows.jsonl files, chosen columns."""

import json

from jaxrl_llm.bench.table import table


def test_a_sections_rows_from_both_file_kinds(tmp_path):
    rows = [{"section": "e2e", "step": 0, "wall_s": 50.123456}, {"section": "other", "step": 9},
            {"section": "e2e", "step": 1, "wall_s": 40.0}]
    (tmp_path / "off.json").write_text(json.dumps({"meta": {}, "results": rows}))
    (tmp_path / "on.rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    out = table([str(tmp_path / "off.json"), str(tmp_path / "on.rows.jsonl")], "e2e", ["step", "wall_s", "x"])
    assert out.splitlines() == ["| run | step | wall_s | x |", "|---|---|---|---|", "| off | 0 | 50.12 |  |",
                                "| off | 1 | 40 |  |", "| on | 0 | 50.12 |  |"]
