"""Fixtures shared by the bench harness's tests."""

import pytest

from jaxrl_llm.bench.harness import ROWS


@pytest.fixture
def own_rows():
    """The harness keeps rows in one process-wide list: a test's rows neither see nor outlive others'."""
    ROWS.rows.clear()
    yield
    ROWS.rows.clear()


@pytest.fixture(autouse=True)
def _no_gin_bindings():
    """The sections build their RunConfigs in code, but its dataclasses are gin-configurable: bindings an earlier
    test on this worker parsed (`train.n_gpus_per_node=1`, ...) would reach them (CI: the sync run's mesh saw one
    device). Each bench test starts with none."""
    import gin

    gin.clear_config()
    yield
