"""Custom reward functions loaded by path + name (veRL's custom_reward_function), and their errors."""

import pytest

from jaxrl_llm.rewards import RewardConfigError, load_custom_reward_fn

GOOD = '''
def my_reward(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return float(solution_str.strip() == ground_truth) + bonus

NOT_A_FUNCTION = 3
'''


def _write(tmp_path, text, name="reward.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_loads_and_binds_reward_kwargs(tmp_path):
    path = _write(tmp_path, GOOD)
    fn = load_custom_reward_fn(path, "my_reward")
    assert fn("x", " 5 ", "5") == 1.0
    assert load_custom_reward_fn(path, "my_reward", {"bonus": 0.5})("x", "4", "5") == 0.5


def test_missing_path(tmp_path):
    with pytest.raises(RewardConfigError, match=r"nope\.py' does not exist"):
        load_custom_reward_fn(str(tmp_path / "nope.py"), "my_reward")
    with pytest.raises(RewardConfigError, match="is not a file"):
        load_custom_reward_fn(str(tmp_path), "my_reward")


def test_import_failure_shows_the_message_not_a_traceback(tmp_path):
    path = _write(tmp_path, "x = 1\nraise ValueError('bad config value')\n")
    with pytest.raises(RewardConfigError) as info:
        load_custom_reward_fn(path, "my_reward")
    msg = str(info.value)
    assert f"{path}:2 failed to import: ValueError: bad config value" in msg
    assert "Traceback" not in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__

    path = _write(tmp_path, "def f(:\n", name="syntax.py")
    with pytest.raises(RewardConfigError, match="syntax.py.* failed to import: SyntaxError"):
        load_custom_reward_fn(path, "f")


def test_name_missing_or_not_callable(tmp_path):
    path = _write(tmp_path, GOOD)
    with pytest.raises(RewardConfigError, match=r"'compute_score' is not defined .*there: \['my_reward'\]"):
        load_custom_reward_fn(path, "compute_score")
    with pytest.raises(RewardConfigError, match="'NOT_A_FUNCTION' .* is a int, not a callable"):
        load_custom_reward_fn(path, "NOT_A_FUNCTION")
    with pytest.raises(RewardConfigError, match="name is empty"):
        load_custom_reward_fn(path, "")
