"""Prompt data: veRL-schema parquet/jsonl sources, chat templating and length filtering, and a
seeded iterator that resumes exactly."""

from jaxrl_llm.data.dataset import PromptDataset
from jaxrl_llm.data.errors import DataError
from jaxrl_llm.data.gsm8k import build_gsm8k_rows, load_gsm8k_rows, write_gsm8k_parquet
from jaxrl_llm.data.iterator import PromptIterator
from jaxrl_llm.data.sources import SourceRow, read_rows

__all__ = [
    "DataError",
    "PromptDataset",
    "PromptIterator",
    "SourceRow",
    "build_gsm8k_rows",
    "load_gsm8k_rows",
    "read_rows",
    "write_gsm8k_parquet",
]
