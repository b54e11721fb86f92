"""Reward functions by name, and `default_compute_score`, which picks one by a sample's data_source.

A registered function has the signature `fn(solution_str, ground_truth, extra_info=None)` and returns
a float or a dict with a "score" key (plus extra per-sample metrics). Register your own with

    @register_reward("my_org/my_dataset")
    def my_score(solution_str, ground_truth, extra_info=None): ...

The built-in functions (gsm8k, format) register themselves when `jaxrl_llm.rewards` is imported.
`RewardManager` sends a snapshot of the table to its Ray workers, so functions registered in the
driver script work there too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_llm.rewards.errors import RewardConfigError

RewardFn = Callable[..., Any]

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(*names: str, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: registers `fn` under each of `names` (data_source values or reward names)."""
    if not names or not all(isinstance(n, str) and n for n in names):
        raise RewardConfigError(f"register_reward{names!r}: give one or more non-empty string names")

    def decorate(fn: RewardFn) -> RewardFn:
        for name in names:
            if name in _REGISTRY and _REGISTRY[name] is not fn and not overwrite:
                raise RewardConfigError(
                    f"register_reward: {name!r} is already registered to {_REGISTRY[name].__qualname__}; "
                    "pick another name or pass overwrite=True")
            _REGISTRY[name] = fn
        return fn

    return decorate


def registry_snapshot() -> dict[str, RewardFn]:
    """A copy of the table, for `restore_registry` in another process (a Ray reward worker)."""
    return dict(_REGISTRY)


def restore_registry(snapshot: dict[str, RewardFn]) -> None:
    """Adds a snapshot's entries to this process's table (they win over entries with the same name)."""
    _REGISTRY.update(snapshot)


def registered_rewards() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def get_reward_fn(name: str) -> RewardFn:
    """The function registered under `name`; one clear error if there is none."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise RewardConfigError(
            f"no reward function is registered for {name!r}; registered: {registered_rewards()}. "
            "Register one with @jaxrl_llm.rewards.register_reward(name), or set a custom reward "
            "function (path + name).") from None


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None) -> float | dict:
    """Scores one response with the function registered for its data_source (veRL's dispatcher).

    Returns a number as a float; anything else (a dict with a "score" key, or a bad value) unchanged,
    so that `RewardManager` can check it and count it.
    """
    result = get_reward_fn(data_source)(solution_str, ground_truth, extra_info)
    if isinstance(result, bool | int | float | np.number):
        return float(result)
    return result
