"""The reward registry, the dispatcher's errors and the format reward."""

import pytest

from jaxrl_llm.rewards import (
    FORMAT_REWARD_NAME,
    RewardConfigError,
    compute_format_score,
    default_compute_score,
    get_reward_fn,
    register_reward,
    registered_rewards,
)
from jaxrl_llm.rewards import registry as registry_module


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))


def test_builtins_are_registered():
    assert {"openai/gsm8k", "gsm8k", FORMAT_REWARD_NAME} <= set(registered_rewards())


def test_unknown_data_source_is_one_clear_error():
    message = r"'my/data'.*registered: \[.*'openai/gsm8k'.*register_reward"
    with pytest.raises(RewardConfigError, match=message):
        default_compute_score("my/data", "#### 1", "1")


def test_register_reward_extends_the_dispatcher(clean_registry):
    @register_reward("my/data", "my/data-v2")
    def exact(solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth), "length": len(solution_str)}

    assert default_compute_score("my/data-v2", "a", "a") == {"score": 1.0, "length": 1}
    assert get_reward_fn("my/data") is exact
    with pytest.raises(RewardConfigError, match="already registered"):
        register_reward("my/data")(lambda s, g, e=None: 0.0)
    register_reward("my/data", overwrite=True)(lambda s, g, e=None: 0)
    assert default_compute_score("my/data", "a", "a") == 0.0                # ints come back as floats
    with pytest.raises(RewardConfigError, match="non-empty string"):
        register_reward()


@pytest.mark.parametrize("response, expected", [
    ("step 1\nstep 2\n#### 72", 1.0),
    ("#### 1,234.5\n\n", 1.0),
    ("#### -7", 1.0),
    ("#### $12", 1.0),
    ("#### 72 apples", 0.0),        # not only a number
    ("#### 72\nI hope this helps", 0.0),
    ("The answer is 72", 0.0),
    ("####72", 0.0),
    ("#### 12,34", 0.0),            # not a thousands separator
    ("", 0.0),
])
def test_format_reward(response, expected):
    assert compute_format_score(response) == expected
    assert default_compute_score(FORMAT_REWARD_NAME, response, None) == expected
