"""Data-test fixtures: the real Qwen2 tokenizer (loaded once) and GSM8K prepared by the real script."""

import pathlib
import subprocess
import sys

import pytest
import transformers

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def qwen2_tokenizer(qwen2_tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(str(qwen2_tokenizer_dir))


@pytest.fixture(scope="session")
def gsm8k_parquet_dir(gsm8k_dir, tmp_path_factory) -> pathlib.Path:
    """train/test.parquet written by `python scripts/prepare_gsm8k.py` from the shared jsonl."""
    out = tmp_path_factory.mktemp("gsm8k_parquet")
    subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_gsm8k.py"),
                    "--local_dataset_path", str(gsm8k_dir), "--local_save_dir", str(out)],
                   check=True, capture_output=True, text=True, cwd=REPO)
    return out
