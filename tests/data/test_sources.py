"""Reading veRL-schema rows from parquet and jsonl, and one clear error for each unusable input."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_llm.data import DataError, read_rows


def row(content="What is 1+1?", ground_truth="2", data_source="openai/gsm8k", **extra):
    return {"data_source": data_source, "prompt": [{"role": "user", "content": content}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"index": 0}, **extra}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows, metadata=None):
    table = pa.Table.from_pylist(rows)
    if metadata:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, path)
    return str(path)


def test_parquet_and_jsonl_read_alike_and_in_order(tmp_path):
    rows = [row(f"q{i}", str(i)) for i in range(3)]
    # veRL's parquet comes from HF `datasets`, which adds its own schema metadata; it must not matter.
    pq_path = write_parquet(tmp_path / "a.parquet", rows, {"huggingface": '{"info": {}}'})
    jl_path = write_jsonl(tmp_path / "b.jsonl", rows[:2])
    got = read_rows([pq_path, jl_path])
    assert [r.data for r in got] == rows + rows[:2]
    assert [(r.file, r.row) for r in got] == [(pq_path, 0), (pq_path, 1), (pq_path, 2),
                                              (jl_path, 0), (jl_path, 1)]
    assert got[4].where == f"{jl_path} row 1"
    assert [r.data for r in read_rows(pq_path)] == rows        # one path, not a list


def test_missing_unreadable_and_unknown_files(tmp_path):
    with pytest.raises(DataError, match=r"nope.parquet: no such dataset file"):
        read_rows(str(tmp_path / "nope.parquet"))
    with pytest.raises(DataError, match="is a directory"):
        read_rows(str(tmp_path))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data.csv: unknown file type.*\('.parquet', '.jsonl'\)"):
        read_rows(str(tmp_path / "data.csv"))
    with pytest.raises(DataError, match="no dataset files given"):
        read_rows([])


def test_corrupt_parquet(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(DataError, match=r"junk.parquet: cannot read it as parquet .*corrupt"):
        read_rows(str(tmp_path / "junk.parquet"))
    good = write_parquet(tmp_path / "good.parquet", [row() for _ in range(50)])
    data = open(good, "rb").read()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])       # a half-copied file
    with pytest.raises(DataError, match=r"cut.parquet: cannot read it as parquet"):
        read_rows(str(tmp_path / "cut.parquet"))


def test_missing_column_in_parquet_names_file_and_field(tmp_path):
    rows = [{k: v for k, v in row().items() if k != "reward_model"}]
    path = write_parquet(tmp_path / "x.parquet", rows)
    with pytest.raises(DataError, match=r"x.parquet: no column 'reward_model' \(columns: .*'prompt'"):
        read_rows(path)
    path = write_parquet(tmp_path / "y.parquet", [row()])
    with pytest.raises(DataError, match=r"y.parquet: no column 'question'"):
        read_rows(path, prompt_key="question")


@pytest.mark.parametrize("bad, field", [
    ({"reward_model": {"style": "rule"}}, "reward_model.ground_truth"),
    ({"reward_model": {"style": "rule", "ground_truth": None}}, "reward_model.ground_truth"),
    ({"data_source": ""}, "data_source"),
    ({"prompt": None}, "prompt"),
])
def test_missing_field_names_file_row_and_field(tmp_path, bad, field):
    rows = [row(), row(), {**row(), **bad}, {**row(), **bad}]
    for path in (write_jsonl(tmp_path / "d.jsonl", rows), write_parquet(tmp_path / "d.parquet", rows)):
        with pytest.raises(DataError, match=rf"d\.(jsonl|parquet) row 2: field '{field}' is missing or null "
                                            r"\(1 more rows"):
            read_rows(path)


def test_bad_jsonl_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row()) + "\n\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl line 3: not valid JSON"):
        read_rows(str(path))
    path.write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"bad.jsonl line 1: a list, not a JSON object"):
        read_rows(str(path))


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"the dataset is empty: no rows in .*empty.jsonl"):
        read_rows(str(tmp_path / "empty.jsonl"))
    empty_parquet = write_parquet(tmp_path / "empty.parquet", [row()])
    pq.write_table(pq.read_table(empty_parquet).slice(0, 0), empty_parquet)
    with pytest.raises(DataError, match="the dataset is empty"):
        read_rows(empty_parquet)


IMAGE = {"path": "cat.png"}


@pytest.mark.parametrize("extra, field", [
    ({"images": [IMAGE]}, "images"),  # veRL's image_key, the <image> placeholder in the prompt
    ({"videos": [{"path": "clip.mp4"}]}, "videos"),
    ({"multi_modal_data": {"image": [IMAGE]}}, "multi_modal_data"),
    ({"prompt": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                              {"type": "text", "text": "What is this?"}]}]}, "prompt[0].content"),
    ({"prompt": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}]},
     "prompt[1].content"),
])
def test_a_row_with_images_is_one_error_naming_the_field(tmp_path, extra, field):
    """jaxrl_llm trains the language model only: images are refused, not dropped from the prompt silently."""
    rows = [row(), {**row(), **extra}, {**row(), **extra}]
    paths = [write_jsonl(tmp_path / "d.jsonl", rows)]
    if "prompt" not in extra:  # parquet: the column on every row, null where a row has none
        paths.append(write_parquet(tmp_path / "d.parquet", [{**row(), **{k: None for k in extra}}, *rows[1:]]))
    for path in paths:
        with pytest.raises(DataError, match=rf"d\.(jsonl|parquet) row 1: '{re.escape(field)}' carries images or "
                                            r"videos \(1 more rows.*jaxrl_llm trains the language model only"):
            read_rows(path)
    # An empty or null column is no image.
    empty = [row(images=[], multi_modal_data=None), row(images=None, videos=[])]
    for path in (write_jsonl(tmp_path / "e.jsonl", empty), write_parquet(tmp_path / "e.parquet", empty)):
        assert len(read_rows(path)) == 2
