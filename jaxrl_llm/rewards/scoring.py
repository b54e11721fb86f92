"""Which reward function to run, and scoring a list of samples with it (in-process or in a Ray worker).

A reward function is described by a picklable *spec*, so that a Ray worker can rebuild it:
  None                        `default_compute_score`: by each sample's data_source (veRL's default)
  "name"                      the registered function `name`, for every sample (e.g. "gsm8k_format")
  CustomRewardFunction(...)   a user function loaded from a file (veRL's `custom_reward_function`)
  a callable                  used as is; with Ray workers it must pickle (a module-level function)
Every resolved function has veRL's signature `fn(data_source, solution_str, ground_truth, extra_info)`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.rewards.custom import load_custom_reward_fn
from jaxrl_llm.rewards.errors import RewardConfigError
from jaxrl_llm.rewards.registry import default_compute_score, get_reward_fn, restore_registry

# (data_source, response, ground_truth, extra_info)
Sample = tuple[str, str, Any, dict | None]


@dataclasses.dataclass(frozen=True)
class CustomRewardFunction:
    """veRL's `custom_reward_function` config: a function `name` in the Python file `path`."""

    path: str
    name: str
    reward_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SampleResult:
    """The outcome of scoring one sample.

    `problem` is None, "error" (the function raised), "nonfinite" (it returned NaN, inf or a value
    that is not a number) or "config" (a `RewardConfigError`, e.g. an unknown data_source: a setup
    bug, not a bad sample); then `score` is 0.0, `message` says what happened and `trace` holds the
    function's traceback (for "error").
    """

    score: float
    problem: str | None = None
    message: str = ""
    trace: str = ""
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)


def _call_registered(name: str, data_source, solution_str, ground_truth, extra_info=None):
    return get_reward_fn(name)(solution_str, ground_truth, extra_info)


def resolve_reward_fn(spec) -> Callable:
    """The callable `fn(data_source, solution_str, ground_truth, extra_info)` that `spec` describes."""
    if spec is None:
        return default_compute_score
    if isinstance(spec, str):
        get_reward_fn(spec)  # fails now, with the list of registered names, rather than per sample
        return functools.partial(_call_registered, spec)
    if isinstance(spec, CustomRewardFunction):
        return load_custom_reward_fn(spec.path, spec.name, spec.reward_kwargs)
    if callable(spec):
        return spec
    raise RewardConfigError(
        f"reward_fn={spec!r} is not a reward function spec; pass None (dispatch by data_source), a "
        "registered name, CustomRewardFunction(path, name) or a callable")


def _as_float(value) -> float | None:
    """`value` as a finite float, or None if it is not one."""
    if isinstance(value, bool | int | float | np.number):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.ndarray) and value.size == 1 and np.issubdtype(value.dtype, np.number):
        return _as_float(value.item())
    return None


def _check_result(result) -> SampleResult:
    extras = {}
    value = result
    if isinstance(result, dict):
        if "score" not in result:
            return SampleResult(0.0, "nonfinite",
                                f"returned a dict without a 'score' key: keys {sorted(result)}")
        value = result["score"]
        extras = {k: v for k, v in result.items() if k != "score"}
    score = _as_float(value)
    if score is None:
        message = f"returned {value!r} ({type(value).__name__}), not a finite number"
        return SampleResult(0.0, "nonfinite", message, extras=extras)
    return SampleResult(score, extras=extras)


def score_samples(fn: Callable, samples: Sequence[Sample]) -> list[SampleResult]:
    """Scores each sample with `fn`; never raises: failures come back as results with a `problem`."""
    results = []
    for data_source, response, ground_truth, extra_info in samples:
        try:
            result = fn(data_source, response, ground_truth, extra_info)
        except RewardConfigError as e:
            results.append(SampleResult(0.0, "config", str(e)))
            continue
        except Exception as e:
            # Drop the first frame (this function); keep the reward function's own frames.
            trace = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            results.append(SampleResult(0.0, "error", f"{type(e).__name__}: {e}", trace=trace))
            continue
        results.append(_check_result(result))
    return results


class RewardWorker:
    """The body of one Ray reward worker: rebuilds the function from its spec once, then scores chunks.

    `registry` is the driver's registry table, so that functions the user registered in the driver
    (which a fresh worker process has never imported) dispatch in the worker too.
    """

    def __init__(self, spec, registry: dict[str, Callable] | None = None):
        if registry:
            restore_registry(registry)
        self._fn = resolve_reward_fn(spec)

    def score(self, samples: Sequence[Sample]) -> list[SampleResult]:
        return score_samples(self._fn, samples)
