"""Fixtures shared by the paged engine's tests."""

import pytest

from jaxrl_llm.models import load_hf, split_model
from tests.hf_models import make_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(config, params) of a tiny random Qwen2 written by transformers and read back: 96 tokens, eos 7, weights
    at initializer_range 0.3 so that greedy decoding varies from token to token."""
    d = tmp_path_factory.mktemp("hf")
    make_hf_model(d, vocab_size=96, initializer_range=0.3, eos_token_id=7)
    m = load_hf(d)
    return m.cfg, split_model(m)[1]
