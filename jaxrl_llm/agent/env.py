"""Environments: a counterpart with state that answers each assistant turn (a user simulator, a game,
a checker), driven by the agent loop next to tools.

The interface is gym-like and text-based:

    env.reset(row) -> messages                                   # the conversation the model starts from
    env.step(calls_or_text) -> (messages, reward, done, info)    # after each assistant turn

`reset` gets the dataset row (with `messages`, `extra_info`, ...) and returns the initial messages,
which the loop renders with the chat template into the trajectory's prompt. `step` gets the assistant
turn's parsed tool calls when the run's call format finds any (and `parse_calls` is on), else its text;
the messages it returns (role 'user' or 'tool') are appended to the response under loss mask 0, its
reward is added to the trajectory's (`extra_info['rollout_reward_scores']['env']` for the reward
function), and `done` ends the trajectory. One instance serves one trajectory.

Which environment a row gets: a row whose `agent_name` is a registered environment's name gets it; a
'tool_agent' row gets the one named in `extra_info.interaction_kwargs.name` (veRL's per-row interaction
key), else `rollout.multi_turn.env`, else none (a plain tool-calling trajectory). Environments come from
`register_env` in Python or from veRL's interaction YAML (`rollout.multi_turn.interaction_config_path`:
`interaction: [{name, class_name, config}]`); a veRL-style interaction class (`start_interaction`,
`generate_response`, `calculate_score`, `finalize_interaction`, sync or async) is wrapped by
`InteractionEnv`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import os
import re
from collections.abc import Callable

from jaxrl_llm.rewards.registry import register_reward

_ROLES = ("user", "tool", "system")


class EnvError(ValueError):
    """An environment that cannot be built or selected (an unknown name, a bad interaction YAML)."""


class Environment:
    """The base of an environment: override `reset` and `step` (and `close` to free resources).

    Args:
      config: the environment's settings (`config` of its interaction YAML entry, or
        `rollout.multi_turn.env_kwargs`).
    """

    parse_calls = True  # step() gets the parsed calls when the format finds any; False: always the text

    def __init__(self, config: dict | None = None):
        self.config = dict(config or {})

    def reset(self, row: dict) -> list[dict]:
        """The initial messages of the trajectory of `row` (a dataset item). By default the row's own."""
        return [dict(m) for m in row["messages"]]

    def step(self, action) -> tuple[list[dict], float, bool, dict]:
        """(messages to append, reward of this step, done, info) after one assistant turn; `action` is
        a list of `ToolCall` / `ToolCallError`, or the turn's text."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once when the trajectory ends, whatever the reason."""


_REGISTRY: dict[str, Callable[[dict], Environment]] = {}


def register_env(name: str, *, overwrite: bool = False):
    """Registers an environment factory (a class or a function of the config dict) under `name`."""

    def decorate(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory and not overwrite:
            raise EnvError(f"an environment is already registered as {name!r}; pick another name or pass "
                           "overwrite=True")
        _REGISTRY[name] = factory
        return factory
    return decorate


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)


def get_env_factory(name: str) -> Callable[[dict], Environment]:
    if name not in _REGISTRY:
        raise EnvError(f"no environment is registered as {name!r}; registered: {registered_envs()} (register one "
                       "with jaxrl_llm.agent.env.register_env, or list it in rollout.multi_turn."
                       "interaction_config_path)")
    return _REGISTRY[name]


def load_interaction_config(path: str) -> list[str]:
    """Registers the entries of veRL's interaction YAML (`interaction: [{name, class_name, config}]`);
    returns their names. A class that is not an `Environment` is taken as a veRL interaction and wrapped."""
    from jaxrl_llm.agent.tools import yaml_entries

    entries = yaml_entries(os.path.expanduser(os.fspath(path)), section="interaction",
                           setting="rollout.multi_turn.interaction_config_path",
                           expected="veRL's interaction YAML: interaction: [{name, class_name, config}]",
                           error=EnvError)
    names = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise EnvError(f"{path}: interaction entry {i} needs a 'class_name' (module.Class)")
        module, _, attr = str(entry["class_name"]).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise EnvError(f"{path}: interaction entry {i}: cannot import {entry['class_name']!r} ({e})") from None
        config = dict(entry.get("config") or {})
        name = entry.get("name") or config.get("name") or attr
        config.setdefault("name", name)
        if isinstance(cls, type) and issubclass(cls, Environment):
            factory = lambda cfg, cls=cls, config=config: cls({**config, **cfg})
        else:
            shared = cls(config)  # veRL keeps one interaction object per name, its state keyed by instance id
            factory = lambda cfg, shared=shared: InteractionEnv(shared)
        register_env(name, overwrite=True)(factory)
        names.append(name)
    return names


def _await(value):
    return asyncio.run(value) if inspect.isawaitable(value) else value


class InteractionEnv(Environment):
    """A veRL-style interaction as an environment. reset: `start_interaction(instance_id,
    **interaction_kwargs)`; step: `generate_response(instance_id, messages, **interaction_kwargs)` ->
    (should_terminate, content, score, extra), its content a user message; close: `finalize_interaction`.
    The interaction reads the conversation, so `step` gets the text (`parse_calls` off)."""

    parse_calls = False

    def __init__(self, interaction):
        super().__init__(getattr(interaction, "config", None))
        self.interaction = interaction
        self.kwargs: dict = {}
        self.messages: list[dict] = []
        self.instance_id: str | None = None

    def reset(self, row: dict) -> list[dict]:
        self.kwargs = dict((row.get("extra_info") or {}).get("interaction_kwargs") or {})
        self.messages = [dict(m) for m in row["messages"]]
        self.instance_id = _await(self.interaction.start_interaction(None, **self.kwargs))
        return [dict(m) for m in self.messages]

    def step(self, action):
        self.messages.append({"role": "assistant", "content": action if isinstance(action, str) else str(action)})
        done, content, score, extra = _await(self.interaction.generate_response(self.instance_id, self.messages,
                                                                               **self.kwargs))
        new = [{"role": "user", "content": content}]
        self.messages += new
        return new, score, bool(done), dict(extra or {})

    def close(self) -> None:
        if self.instance_id is None:
            return
        finalize = self.interaction.finalize_interaction
        takes_id = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                       for p in inspect.signature(finalize).parameters.values())
        _await(finalize(self.instance_id) if takes_id else finalize())


def check_step(out) -> tuple[list[dict], float, bool, dict]:
    """`step`'s return value, checked: a ValueError that says what is wrong, else the normalised tuple."""
    if not isinstance(out, tuple) or len(out) != 4:
        raise ValueError(f"step() returned {type(out).__name__}; it must return (messages, reward, done, info)")
    messages, reward, done, info = out
    messages = check_messages(messages, "step()")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"step() returned reward {reward!r}; it must be a finite number")
    if not isinstance(done, bool):
        raise ValueError(f"step() returned done {done!r}; it must be a bool")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"step() returned info of type {type(info).__name__}; it must be a dict or None")
    return messages, float(reward), done, dict(info or {})


def check_messages(messages, where: str, roles=_ROLES) -> list[dict]:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"{where} returned {str(messages)[:200]!r}; it must return a list of "
                         f"{{'role': one of {roles}, 'content': str}} messages")
    return [dict(m) for m in messages]


# ---- a small real environment: guess the number --------------------------------------------------------

@register_env("guess_number")
class GuessNumberEnv(Environment):
    """Guess a secret integer: after each assistant turn the user says whether the secret is higher or
    lower than the turn's last number (or asks for one), and the game ends when it is guessed (reward
    1.0). The secret is the row's `extra_info.interaction_kwargs.secret` (else its ground truth).

    Config: `higher`, `lower`, `invalid` (the user's words; e.g. '+' / '-' for a tokenizer without
    letters) and `reward` (for the right guess).
    """

    parse_calls = False

    def reset(self, row: dict) -> list[dict]:
        kwargs = (row.get("extra_info") or {}).get("interaction_kwargs") or {}
        secret = kwargs.get("secret", row.get("ground_truth", (row.get("reward_model") or {}).get("ground_truth")))
        self.secret = int(secret)
        self.guesses = 0
        return super().reset(row)

    def step(self, action):
        numbers = re.findall(r"-?\d+", action if isinstance(action, str) else "")
        if not numbers:
            return [{"role": "user", "content": self.config.get("invalid", "Guess a number.")}], 0.0, False, {}
        guess = int(numbers[-1])
        self.guesses += 1
        if guess == self.secret:
            return [], float(self.config.get("reward", 1.0)), True, {"guesses": self.guesses}
        word = self.config.get("higher", "higher") if self.secret > guess else self.config.get("lower", "lower")
        return [{"role": "user", "content": word}], 0.0, False, {}


@register_reward("guess_number")
def guess_number_score(solution_str, ground_truth, extra_info=None) -> float:
    """The environment's reward (its steps' sum), as the loop hands it to reward functions."""
    return float(((extra_info or {}).get("rollout_reward_scores") or {}).get("env", 0.0))


# ---- the agent loop's side -----------------------------------------------------------------------------

class EnvSelector:
    """Picks each row's environment (see the module docstring) and builds one instance per trajectory.

    Args:
      config: `rollout.multi_turn.*`: `env` (the default environment's name), `env_kwargs` (its config)
        and `interaction_config_path` (veRL's interaction YAML, registered here).
    """

    def __init__(self, config):
        if getattr(config, "interaction_config_path", None):
            load_interaction_config(config.interaction_config_path)
        self.default = getattr(config, "env", None)
        self.kwargs = dict(getattr(config, "env_kwargs", None) or {})
        if self.default is not None:
            get_env_factory(self.default)  # an unknown name fails here, before the first rollout

    def make(self, row: dict) -> Environment | None:
        agent = row.get("agent_name") or "tool_agent"
        kwargs = (row.get("extra_info") or {}).get("interaction_kwargs") or {}
        name = agent if agent in _REGISTRY else kwargs.get("name") or self.default
        if name is None:
            return None
        try:
            env = get_env_factory(name)(dict(self.kwargs))
        except EnvError:
            raise
        except Exception as e:  # noqa: BLE001 (the environment's own code: one error naming it, not a traceback)
            raise EnvError(f"environment {name!r} could not be built: its constructor raised {type(e).__name__}: {e}; "
                           "fix the environment class or its config (rollout.multi_turn.env_kwargs, or the "
                           "interaction YAML's config)") from e
        if not isinstance(env, Environment):
            raise EnvError(f"environment {name!r}: its factory returned {type(env).__name__}, not an Environment")
        return env


async def call_env(runner, fn, *args) -> tuple[object, str | None]:
    """(result, None), or (None, why) when `fn` raised or ran past the runner's timeout: an environment's
    method on the tool runner's threads (or its loop, when async)."""
    from jaxrl_llm.agent.tool_runner import _with_timeout

    try:
        return await _with_timeout(runner.invoke(fn, *args), runner.timeout_s), None
    except TimeoutError:
        return None, f"timed out after {runner.timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 (an env's fault is counted, not raised)
        return None, f"raised {type(e).__name__}: {e}"
