"""scripts/prepare_gsm8k.py: veRL-schema parquet from the shared GSM8K jsonl, read back as prompts."""

import importlib.util
import json
import pathlib
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_llm.data import DataError, PromptDataset, PromptIterator, build_gsm8k_rows, load_gsm8k_rows
from jaxrl_llm.data.gsm8k import INSTRUCTION
from jaxrl_llm.rewards import default_compute_score

REPO = pathlib.Path(__file__).resolve().parents[2]

STRUCT_TYPES = {
    "reward_model": pa.struct([("style", pa.string()), ("ground_truth", pa.string())]),
    "extra_info": pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                             ("question", pa.string())]),
    "prompt": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
}


def _script():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", REPO / "scripts" / "prepare_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("split, n", [("train", 7473), ("test", 1319)])
def test_parquet_has_verl_schema(gsm8k_parquet_dir, gsm8k_dir, split, n):
    table = pq.read_table(gsm8k_parquet_dir / f"{split}.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    for name, arrow_type in STRUCT_TYPES.items():
        assert table.schema.field(name).type == arrow_type
    rows = table.to_pylist()
    with open(gsm8k_dir / f"{split}.jsonl") as f:
        raw = [json.loads(line) for line in f]
    assert len(rows) == len(raw) == n
    for i in (0, n // 2, n - 1):
        assert rows[i] == {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": raw[i]["question"] + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule",
                             "ground_truth": raw[i]["answer"].split("#### ")[1].replace(",", "")},
            "extra_info": {"split": split, "index": i, "answer": raw[i]["answer"],
                           "question": raw[i]["question"]},
        }
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    with_commas = [r for r, x in zip(rows, raw) if "," in x["answer"].split("####")[1]]
    assert with_commas and all("," not in r["reward_model"]["ground_truth"] for r in with_commas)


def test_prepared_gsm8k_to_prompts_with_qwen2(gsm8k_parquet_dir, qwen2_tokenizer):
    ds = PromptDataset(str(gsm8k_parquet_dir / "test.parquet"), qwen2_tokenizer, max_prompt_length=512,
                       max_samples=200)
    assert len(ds) == ds.num_rows_read == 200
    assert ds.filter_counts == {"empty": 0, "ground_truth": 0, "overlong": 0}
    item = ds[7]
    question = item["extra_info"]["question"]
    assert item["raw_prompt"] == qwen2_tokenizer.apply_chat_template(
        [{"role": "user", "content": question + " " + INSTRUCTION}], add_generation_prompt=True,
        tokenize=False)
    assert item["raw_prompt"].endswith("<|im_start|>assistant\n")
    assert qwen2_tokenizer.decode(item["prompt_ids"]) == item["raw_prompt"]
    assert item["prompt_ids"][-3:] == qwen2_tokenizer("<|im_start|>assistant\n")["input_ids"]
    assert (item["index"], item["data_source"]) == (7, "openai/gsm8k")
    # The reference solution scores 1.0 against the prepared ground truth: data and rewards agree.
    assert all(default_compute_score(it["data_source"], it["extra_info"]["answer"], it["ground_truth"]) == 1.0
               for it in ds)
    batches = PromptIterator(ds, 64, seed=0)
    assert batches.steps_per_epoch == 3 and len(next(batches)) == 64


def test_build_rows_errors_name_the_row():
    with pytest.raises(DataError, match=r"GSM8K train \(x.jsonl\) row 1: the answer has no '#### <number>'"):
        build_gsm8k_rows([{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "1"}], "train",
                         where="(x.jsonl)")
    with pytest.raises(DataError, match=r"row 0: needs string fields 'question' and 'answer', got keys"):
        build_gsm8k_rows([{"q": 1}], "test")


def test_local_dir_errors(tmp_path):
    with pytest.raises(DataError, match="not a directory; pass --local_dataset_path"):
        load_gsm8k_rows("train", str(tmp_path / "missing"))
    with pytest.raises(DataError, match="no train.jsonl"):
        load_gsm8k_rows("train", str(tmp_path))
    with pytest.raises(DataError, match="split 'dev'"):
        load_gsm8k_rows("dev", str(tmp_path))


def test_hub_without_datasets_package_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)      # makes `import datasets` fail
    with pytest.raises(DataError, match="`datasets` package is not installed.*pass --local_dataset_path"):
        load_gsm8k_rows("train")
    assert _script().main(["--local_save_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepare_gsm8k: error: the `datasets` package") and "Traceback" not in err


def test_hub_offline_is_one_clear_error(monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(DataError, match=r"could not load openai/gsm8k .*ConnectionError.*--local_dataset"):
        load_gsm8k_rows("test")


def test_hub_rows_are_built_like_local_ones(monkeypatch, gsm8k_dir):
    with open(gsm8k_dir / "test.jsonl") as f:
        raw = [json.loads(line) for _, line in zip(range(5), f)]
    fake = types.SimpleNamespace(load_dataset=lambda name, config, split: raw if (name, config) == (
        "openai/gsm8k", "main") else None)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert load_gsm8k_rows("test") == load_gsm8k_rows("test", str(gsm8k_dir))[:5]


def test_local_hub_snapshot_layout(tmp_path, gsm8k_dir):
    """A downloaded hub snapshot (main/<split>-*.parquet) works as --local_dataset_path too."""
    with open(gsm8k_dir / "test.jsonl") as f:
        raw = [json.loads(line) for _, line in zip(range(4), f)]
    (tmp_path / "main").mkdir()
    pq.write_table(pa.Table.from_pylist(raw), tmp_path / "main" / "test-00000-of-00001.parquet")
    assert load_gsm8k_rows("test", str(tmp_path)) == load_gsm8k_rows("test", str(gsm8k_dir))[:4]
