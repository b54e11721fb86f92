"""RewardManager on a pool of real Ray workers gives exactly the in-process results."""

import json
import logging
import os

import numpy as np
import pytest

from jaxrl_llm.rewards import RewardConfigError, RewardError, RewardManager, register_reward
from tests.rewards.test_manager import FLAKY

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("ray_local")


def _gsm8k_batch(gsm8k_dir, n=200):
    """Real test questions with a mix of right, wrong and unformatted responses."""
    with open(gsm8k_dir / "test.jsonl") as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    truths = [row["answer"].rsplit("#### ", 1)[1].replace(",", "") for row in rows]
    responses = [row["answer"] if i % 3 == 0 else f"It is {t}." if i % 3 == 1 else "#### 0"
                 for i, (row, t) in enumerate(zip(rows, truths))]
    return ["openai/gsm8k"] * n, responses, truths


def test_ray_pool_matches_in_process(gsm8k_dir):
    batch = _gsm8k_batch(gsm8k_dir)
    expected = RewardManager().score_batch(*batch)
    with RewardManager(num_workers=2) as manager:
        got = manager.score_batch(*batch)
        again = manager.score_batch(*(b[:3] for b in batch))       # the workers are reused
    np.testing.assert_array_equal(got.scores, expected.scores)
    assert got.scores.dtype == np.float32
    assert 0 < got.scores.sum() < len(got.scores)
    np.testing.assert_array_equal(again.scores, expected.scores[:3])


def test_ray_pool_loads_custom_fn_by_path_and_counts_failures(caplog):
    responses = ["5", "boom", "nan", "4", "5", "text", "5"]
    batch = (["ds"] * 7, responses, ["5"] * 7)
    expected = RewardManager(FLAKY).score_batch(*batch)
    with (caplog.at_level(logging.WARNING, logger="jaxrl_llm.rewards.manager"),
          RewardManager(FLAKY, num_workers=2) as manager):
        got = manager.score_batch(*batch)
    np.testing.assert_array_equal(got.scores, expected.scores)
    assert got.metrics == expected.metrics == {"reward/num_errors": 1, "reward/num_nonfinite": 2}
    pids = {p for p in got.extra_info["pid"] if p is not None}
    assert len(pids) == 2 and os.getpid() not in pids                # two real worker processes
    assert any("sample 1 (data_source='ds')" in r.getMessage() and "boom on purpose" in r.getMessage()
               for r in caplog.records)


def test_ray_pool_strict_mode_raises():
    message = r"sample 3 \(data_source='ds'\): ValueError: boom on purpose"
    with (RewardManager(FLAKY, num_workers=2, strict=True) as manager,
          pytest.raises(RewardError, match=message)):
        manager.score_batch(["ds"] * 4, ["1", "1", "1", "boom"], ["1"] * 4)


def test_more_workers_than_cpus_is_a_clear_error():
    with pytest.raises(RewardConfigError, match=r"3 workers x 1 CPU need more than the 2 CPUs"):
        RewardManager(num_workers=3)


def test_functions_registered_in_the_driver_work_in_workers(monkeypatch):
    from jaxrl_llm.rewards import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_reward("driver/only")
    def length_score(solution_str, ground_truth, extra_info=None):    # pickled by value: not importable
        return len(solution_str) / 10

    with RewardManager(num_workers=2) as manager:
        out = manager.score_batch(["driver/only", "gsm8k", "driver/only"], ["abc", "#### 1", "abcde"],
                                  ["", "1", ""])
    np.testing.assert_allclose(out.scores, [0.3, 1.0, 0.5])
