"""RewardManager on a pool of spawned worker processes (no Ray) gives exactly the in-process results."""

import logging
import os

import numpy as np
import pytest

from jaxrl_llm.rewards import RewardError, RewardManager, register_reward
from tests.rewards.test_manager import FLAKY
from tests.rewards.test_manager_ray import _gsm8k_batch


def test_process_pool_matches_in_process(gsm8k_dir):
    batch = _gsm8k_batch(gsm8k_dir)
    expected = RewardManager().score_batch(*batch)
    with RewardManager(num_workers=2, backend="process") as manager:
        got = manager.score_batch(*batch)
        again = manager.score_batch(*(b[:3] for b in batch))  # the workers are reused
    np.testing.assert_array_equal(got.scores, expected.scores)
    assert got.scores.dtype == np.float32 and 0 < got.scores.sum() < len(got.scores)
    np.testing.assert_array_equal(again.scores, expected.scores[:3])


def test_process_pool_loads_custom_fn_by_path_and_counts_failures(caplog):
    responses = ["5", "boom", "nan", "4", "5", "text", "5"]
    batch = (["ds"] * 7, responses, ["5"] * 7)
    expected = RewardManager(FLAKY).score_batch(*batch)
    with (caplog.at_level(logging.WARNING, logger="jaxrl_llm.rewards.manager"),
          RewardManager(FLAKY, num_workers=2, backend="process") as manager):
        got = manager.score_batch(*batch)
    np.testing.assert_array_equal(got.scores, expected.scores)
    assert got.metrics == expected.metrics == {"reward/num_errors": 1, "reward/num_nonfinite": 2}
    pids = {p for p in got.extra_info["pid"] if p is not None}
    # Scored in worker processes (the first one up may take both chunks of a batch this small).
    assert pids and os.getpid() not in pids
    assert any("boom on purpose" in r.getMessage() for r in caplog.records)


def test_process_pool_strict_mode_raises():
    with (RewardManager(FLAKY, num_workers=2, backend="process", strict=True) as manager,
          pytest.raises(RewardError, match=r"sample 3 \(data_source='ds'\): ValueError: boom on purpose")):
        manager.score_batch(["ds"] * 4, ["1", "1", "1", "boom"], ["1"] * 4)


def test_functions_registered_in_the_driver_work_in_processes(monkeypatch):
    from jaxrl_llm.rewards import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_reward("driver/only")
    def length_score(solution_str, ground_truth, extra_info=None):  # a local function: sent by value
        return len(solution_str) / 10

    with RewardManager(num_workers=2, backend="process") as manager:
        out = manager.score_batch(["driver/only", "gsm8k", "driver/only"], ["abc", "#### 1", "abcde"],
                                  ["", "1", ""])
    np.testing.assert_allclose(out.scores, [0.3, 1.0, 0.5])


def test_a_dead_worker_process_is_one_clear_error():
    with RewardManager(FLAKY, num_workers=2, backend="process") as manager:
        manager.score_batch(["ds"] * 2, ["5", "5"], ["5"] * 2)
        for pid in list(manager._pool._processes):
            os.kill(pid, 9)
        with pytest.raises(RewardError, match=r"reward worker process 0 failed while scoring samples 0\.\.1"):
            manager.score_batch(["ds"] * 4, ["5"] * 4, ["5"] * 4)


def test_unknown_backend_is_a_clear_error():
    from jaxrl_llm.rewards import RewardConfigError

    with pytest.raises(RewardConfigError, match="backend='threads'"):
        RewardManager(num_workers=2, backend="threads")
