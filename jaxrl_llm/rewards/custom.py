"""Loads a user's reward function from a Python file: veRL's `custom_reward_function.{path,name}`.

The function has veRL's signature

    fn(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs) -> float | dict

where a dict has a "score" key plus extra per-sample metrics. Each failure to load gives one
`RewardConfigError` that says what is wrong with which file and how to fix it. Ray workers load the
function themselves from (path, name), so it never has to be pickled.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from jaxrl_llm.rewards.errors import RewardConfigError

log = logging.getLogger(__name__)


def _import_file(path: str):
    """Runs `path` as a fresh module, named after the file so that two custom files never clash."""
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = f"jaxrl_llm_custom_reward_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardConfigError(f"custom reward function file {path!r} cannot be imported as Python; "
                                "give the path of a .py file")
    module = importlib.util.module_from_spec(spec)
    # Registered before running, so that pickling and dataclasses inside the file work.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        where = f"{path}:{lines[-1]}" if lines else path
        raise RewardConfigError(
            f"custom reward function file {where} failed to import: {type(e).__name__}: {e}. "
            f"Fix the file (run `python {path}` to see the full traceback).") from None
    return module


def load_custom_reward_fn(path: str, name: str, reward_kwargs: dict[str, Any] | None = None) -> Callable:
    """Returns `name` from the Python file at `path`, with `reward_kwargs` bound as keyword arguments.

    Args:
      path: a .py file (relative paths are taken from the current directory).
      name: a callable defined in it.
      reward_kwargs: extra keyword arguments passed on every call (veRL's `reward_kwargs`).
    """
    if not path:
        raise RewardConfigError("custom reward function: path is empty; give the path of a .py file")
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(path):
        raise RewardConfigError(f"custom reward function file {path!r} does not exist; check "
                                "custom_reward_function.path (relative paths start at the current directory)")
    if not os.path.isfile(path):
        raise RewardConfigError(f"custom reward function path {path!r} is not a file; "
                                "give the path of a .py file")
    if not name:
        raise RewardConfigError(f"custom reward function in {path!r}: name is empty; set "
                                "custom_reward_function.name to the function to call")
    module = _import_file(path)
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardConfigError(f"custom reward function {name!r} is not defined in {path!r}; "
                                f"callables defined there: {defined}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardConfigError(f"custom reward function {name!r} in {path!r} is a {type(fn).__name__}, "
                                "not a callable; point custom_reward_function.name at a function")
    log.info("using custom reward function %r from %s", name, path)
    if reward_kwargs:
        return functools.partial(fn, **reward_kwargs)
    return fn
