"""The run's configuration: one gin-configurable dataclass a section, with veRL's field names where it has them.

A run is configured by gin bindings on short, veRL-like section names (`model.*`, `data.*`, `rollout.*`,
`actor.*`, `critic.*`, `algorithm.*`, `reward.*`, `train.*`, `async_training.*`, and the nested
`actor.policy_loss.*`, `actor.router_replay.*`, `algorithm.filter_groups.*`, ...). `build_run_config()` builds every
section from its bindings into one frozen `RunConfig` and validates it before any model loads, so that a bad
value fails in the first second with one `ConfigValueError` naming the binding to change.

The rooms: `run.py` holds the sections the trainer owns and `RunConfig` itself; `rollout.py` the engine's section,
`async_training.py` the asynchronous modes' and `router_replay.py` MoE routing replay's (each validates its own keys
and their combinations); `check.py`
the shared error and the type check of bound values, which every section uses; `keys.py` reads every key, its
default and its doc back from this source for `--list_keys`, and turns a misspelt or veRL-spelt key into a hint.
This package's namespace is the public face: the rest of the package imports the config from here.
"""

from jaxrl_llm.trainer.config.async_training import AsyncConfig
from jaxrl_llm.trainer.config.check import ConfigValueError
from jaxrl_llm.trainer.config.rollout import RolloutConfig
from jaxrl_llm.trainer.config.router_replay import RouterReplaySettings
from jaxrl_llm.trainer.config.run import (
    PARTS,
    ActorConfig,
    AlgoConfig,
    CriticConfig,
    DataConfig,
    FilterGroupsSettings,
    ModelConfig,
    OverlongBufferSettings,
    PolicyLossSettings,
    RewardConfig,
    RunConfig,
    TrainerConfig,
    build_run_config,
    rollout_correction_enabled,
)

__all__ = ["PARTS", "ActorConfig", "AlgoConfig", "AsyncConfig", "ConfigValueError", "CriticConfig", "DataConfig",
           "FilterGroupsSettings", "ModelConfig", "OverlongBufferSettings", "PolicyLossSettings", "RewardConfig",
           "RolloutConfig", "RouterReplaySettings", "RunConfig", "TrainerConfig", "build_run_config",
           "rollout_correction_enabled"]
