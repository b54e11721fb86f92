"""`rollout.multi_turn.*`: veRL's multi-turn rollout settings, in gin (`rollout.multi_turn.enable = True`).

The settings hang on `RolloutConfig.multi_turn`; the trainer builds the agent loop from them
(`jaxrl_llm.agent.loop`). Tools come from veRL's tool YAML (`tool_config_path`), or from Python
(`tools`, a list of functions or `BaseTool` objects, e.g. bound in gin by a recipe's module).
"""

from __future__ import annotations

import dataclasses
import os

import gin

from jaxrl_llm.errors import ConfigValueError

TRUNCATE_SIDES = ("left", "right", "middle")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigValueError(f"rollout.multi_turn.{key}: {msg}")


@gin.configurable("multi_turn", module="rollout")
@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """veRL's `actor_rollout_ref.rollout.multi_turn.*`, plus the tool timeout and the tool-reward weight.

    enable: run rollouts through the agent loop (assistant turns, tool calls, tool turns).
    max_assistant_turns / max_user_turns: caps on the assistant's turns and on the tool (user-side) turns
      of one trajectory; None is no cap other than data.max_response_length.
    tool_config_path: veRL's tool YAML (tools: [{class_name, config, tool_schema}]).
    tools: tools given in Python (functions with typed signatures, or BaseTool objects), added to the YAML's.
    max_parallel_calls: calls of one assistant turn that run; the rest get a 'too_many_calls' error.
    max_tool_response_length / tool_response_truncate_side: a tool message's characters at most, and which
      part is kept ('left' keeps the start, 'right' the end, 'middle' both ends).
    format: how calls are written: 'hermes' (Qwen's <tool_call>) or 'llama3_json'.
    tool_timeout_s: seconds a call may run before it becomes a 'timeout' error.
    tool_reward_weight: the weight of the tools' rewards (each call's step reward plus the tools'
      calc_reward) added to the final score; 0 leaves them to the reward function, which sees them in
      extra_info['rollout_reward_scores'] (veRL's semantics).
    env / env_kwargs: the environment of rows that name none (a name registered with
      `jaxrl_llm.agent.env.register_env`, e.g. 'guess_number') and its config; None: rows without
      `extra_info.interaction_kwargs.name` or an environment's agent_name run tools only.
    interaction_config_path: veRL's interaction YAML (interaction: [{name, class_name, config}]); its
      entries are registered as environments (veRL interaction classes are wrapped).
    """

    enable: bool = False
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    tool_config_path: str | None = None
    tools: tuple = ()
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"
    tool_timeout_s: float = 30.0
    tool_reward_weight: float = 0.0
    env: str | None = None
    env_kwargs: dict = dataclasses.field(default_factory=dict)
    interaction_config_path: str | None = None

    def validate(self) -> None:
        if not self.enable:
            return
        for key in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, key)
            _check(value is None or (isinstance(value, int) and value >= 1), key,
                   f"{value!r}; give a positive turn count or None (no cap)")
        _check(isinstance(self.max_parallel_calls, int) and self.max_parallel_calls >= 1, "max_parallel_calls",
               f"{self.max_parallel_calls!r}; need >= 1")
        _check(isinstance(self.max_tool_response_length, int) and self.max_tool_response_length >= 1,
               "max_tool_response_length", f"{self.max_tool_response_length!r}; need >= 1 (characters)")
        _check(self.tool_response_truncate_side in TRUNCATE_SIDES, "tool_response_truncate_side",
               f"{self.tool_response_truncate_side!r}; use one of {TRUNCATE_SIDES}")
        _check(self.tool_timeout_s > 0, "tool_timeout_s", f"{self.tool_timeout_s}; need > 0 seconds")
        _check(self.tool_config_path is None or os.path.isfile(self.tool_config_path), "tool_config_path",
               f"{self.tool_config_path!r} is not a file; give veRL's tool YAML (tools: [{{class_name, config, "
               "tool_schema}]) or None")
        _check(self.interaction_config_path is None or os.path.isfile(self.interaction_config_path),
               "interaction_config_path", f"{self.interaction_config_path!r} is not a file; give veRL's interaction "
               "YAML (interaction: [{name, class_name, config}]) or None")
        _check(bool(self.tool_config_path or self.tools or self.env or self.interaction_config_path),
               "tool_config_path", "multi-turn rollouts need tools or an environment: set "
               "rollout.multi_turn.tool_config_path (veRL's tool YAML), rollout.multi_turn.tools, "
               "rollout.multi_turn.env or rollout.multi_turn.interaction_config_path")
        _check(isinstance(self.env_kwargs, dict), "env_kwargs", f"{self.env_kwargs!r}; give a dict")
        from jaxrl_llm.agent.formats import get_format

        try:
            get_format(self.format)
        except (KeyError, ValueError) as e:
            _check(False, "format", str(e))


def make_tool_runner(config: MultiTurnConfig):
    """The run's `ToolRunner`: the tools of `tool_config_path` and `tools`, with the config's caps."""
    from jaxrl_llm.agent.tools import ToolRunner, load_tool_config

    tools = (load_tool_config(config.tool_config_path) if config.tool_config_path else []) + list(config.tools)
    return ToolRunner(tools, max_parallel_calls=config.max_parallel_calls, timeout_s=config.tool_timeout_s,
                      max_tool_response_length=config.max_tool_response_length,
                      tool_response_truncate_side=config.tool_response_truncate_side)


def engine_prompt_length(run) -> int:
    """The longest prompt a rollout engine must accept: `data.max_prompt_length`, or with multi-turn on,
    a later turn's prompt (the prompt plus all but the last token of the response so far)."""
    d = run.data
    return d.max_prompt_length + (d.max_response_length - 1 if run.rollout.multi_turn.enable else 0)
