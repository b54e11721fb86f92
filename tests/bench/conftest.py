"""Fixtures shared by the bench harness's tests."""

import pytest

from jaxrl_llm.bench.harness import ROWS


@pytest.fixture
def own_rows():
    """The harness keeps rows in one process-wide list: a test's rows neither see nor outlive others'."""
    ROWS.rows.clear()
    yield
    ROWS.rows.clear()
