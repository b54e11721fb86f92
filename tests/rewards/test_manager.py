"""RewardManager in-process: scores, extra metrics, and how failing reward functions are handled."""

import logging
import math
import pathlib

import numpy as np
import pytest

from jaxrl_llm.rewards import (
    CustomRewardFunction,
    RewardConfigError,
    RewardError,
    RewardManager,
    resolve_reward_fn,
)

FLAKY = CustomRewardFunction(str(pathlib.Path(__file__).with_name("flaky_reward.py")), "flaky")


def test_default_dispatch_scores_a_batch():
    out = RewardManager().score_batch(
        data_sources=["openai/gsm8k", "gsm8k", "openai/gsm8k"],
        responses=["... #### 72", "#### 71", "72"],
        ground_truths=["72", "72", "72"])
    assert out.scores.dtype == np.float32 and out.scores.shape == (3,)
    np.testing.assert_array_equal(out.scores, [1.0, 0.0, 0.0])
    assert out.metrics == {"reward/num_errors": 0, "reward/num_nonfinite": 0}
    assert out.extra_info == {}


def test_registered_name_applies_to_every_sample():
    out = RewardManager("gsm8k_format").score_batch(["any", "other"], ["#### 3", "3"], ["1", "3"])
    np.testing.assert_array_equal(out.scores, [1.0, 0.0])


def test_failures_score_zero_and_are_logged_and_counted(caplog):
    responses = ["5", "boom", "nan", "4", "inf", "text"]
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.rewards.manager"):
        out = RewardManager(FLAKY).score_batch(["ds"] * 6, responses, ["5"] * 6, [{"i": i} for i in range(6)])
    np.testing.assert_array_equal(out.scores, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert out.metrics == {"reward/num_errors": 1, "reward/num_nonfinite": 3}
    assert out.extra_info["pid"][1:3] == [None, None] and out.extra_info["pid"][0] is not None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4
    assert "raised on sample 1 (data_source='ds')" in lines[0] and "ValueError: boom on purpose" in lines[0]
    assert "sample 2" in lines[1] and "nan" in lines[1]
    assert "sample 4" in lines[2] and "inf" in lines[2]
    assert "sample 5" in lines[3] and "'high' (str), not a finite number" in lines[3]


def test_log_lines_are_capped_per_batch(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.rewards.manager"):
        out = RewardManager(FLAKY, max_logged_problems=2).score_batch(["ds"] * 5, ["boom"] * 5, ["1"] * 5)
    assert out.metrics["reward/num_errors"] == 5
    assert [r.getMessage()[:30] for r in caplog.records][-1].startswith("... and 3 more samples")


def test_strict_mode_raises_naming_the_sample():
    manager = RewardManager(FLAKY, strict=True)
    with pytest.raises(RewardError, match=r"sample 1 \(data_source='b'\): ValueError: boom on purp") as info:
        manager.score_batch(["a", "b"], ["1", "boom"], ["1", "1"])
    assert "flaky_reward.py" in str(info.value)            # the function's own traceback is included
    out = manager.score_batch(["a"], ["nan"], ["1"])         # strict is about raises; NaN still scores 0
    assert out.metrics["reward/num_nonfinite"] == 1


def test_callable_and_reward_kwargs():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return np.float64(len(solution_str))

    np.testing.assert_array_equal(RewardManager(fn).score_batch(["d"], ["abc"], [None]).scores, [3.0])
    spec = CustomRewardFunction(FLAKY.path, "flaky", {"bonus": 0.5})
    np.testing.assert_array_equal(RewardManager(spec).score_batch(["d"], ["1"], ["1"]).scores, [1.5])


def test_setup_errors_are_raised_not_counted():
    with pytest.raises(RewardConfigError, match=r"sample 1 \(data_source='nope'\).*no reward function"):
        RewardManager().score_batch(["gsm8k", "nope"], ["#### 1", "#### 1"], ["1", "1"])
    with pytest.raises(RewardConfigError, match="'not_a_reward'"):
        RewardManager("not_a_reward")
    with pytest.raises(RewardConfigError, match="does not exist"):
        RewardManager(CustomRewardFunction("/no/such/file.py", "f"))
    with pytest.raises(RewardConfigError, match="not a reward function spec"):
        resolve_reward_fn(3)
    with pytest.raises(RewardConfigError, match="num_workers=-1"):
        RewardManager(num_workers=-1)
    with pytest.raises(ValueError, match=r"responses \(1\).*same length"):
        RewardManager().score_batch(["a", "b"], ["x"], ["1", "2"])


def test_check_data_sources_fails_before_any_scoring():
    manager = RewardManager()
    manager.check_data_sources(["openai/gsm8k", "gsm8k", "openai/gsm8k"])
    with pytest.raises(RewardConfigError, match=r"^d\.jsonl: data_source \['my/ds'\] has no reward function"):
        manager.check_data_sources(["gsm8k", "my/ds", "my/ds"], where="d.jsonl")
    RewardManager("gsm8k_format").check_data_sources(["my/ds"])  # one function scores every source
    RewardManager(FLAKY).check_data_sources(["my/ds"])


def test_empty_batch():
    out = RewardManager().score_batch([], [], [])
    assert out.scores.shape == (0,) and out.scores.dtype == np.float32
    assert not math.isnan(out.metrics["reward/num_errors"])
