"""The types the agent package shares: a parsed call, a parse error, a call's result, and the tool
classes (veRL-style `BaseTool`, and `FunctionTool` for a typed Python function).

The public entry point is `jaxrl_llm.agent.tools`, which re-exports these.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import uuid
from collections.abc import Callable
from typing import Any

from jaxrl_llm.agent.tool_schema import ToolSchemaError, check_arguments, function_schema

# The kinds of `ToolResult.error`, and the metric keys `errors/<kind>` a session counts.
ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "raised", "timeout", "too_many_calls")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's `name` and its `arguments` (a JSON object)."""

    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call that could not be parsed (malformed JSON, a missing name, ...): `message` is shown to the
    model, `raw` is the text that failed."""

    message: str
    raw: str


@dataclasses.dataclass
class ToolResult:
    """What one call gave back.

    `text` is the tool message shown to the model (already truncated). `reward` is a per-call step
    reward (veRL's `execute()` reward). `error` is None or one of `ERROR_KINDS`.
    """

    text: str
    reward: float = 0.0
    error: str | None = None
    seconds: float = 0.0


class ToolSchema(dict):
    """An OpenAI function schema: a plain dict (for `apply_chat_template(tools=...)` and JSON), with
    attribute access for code written against veRL's pydantic schema (`schema.function.name`)."""

    def __getattr__(self, key: str) -> Any:
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return ToolSchema(value) if isinstance(value, dict) and not isinstance(value, ToolSchema) else value

    def model_dump(self, **kwargs) -> dict:
        """A plain-dict copy (pydantic's name, which veRL code calls)."""
        return json.loads(json.dumps(self))

    @classmethod
    def wrap(cls, schema: Any, where: str) -> ToolSchema:
        """Checks `schema` has the OpenAI function shape and returns it as a ToolSchema."""
        if hasattr(schema, "model_dump") and not isinstance(schema, dict):
            schema = schema.model_dump()
        function = schema.get("function") if isinstance(schema, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ToolSchemaError(
                f"{where}: tool_schema must look like {{'type': 'function', 'function': {{'name': ..., "
                f"'description': ..., 'parameters': {{...}}}}}}; got {schema!r:.200}")
        params = function.get("parameters", {})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolSchemaError(f"{where}: tool_schema.function.parameters must be a JSON-schema object "
                                  f"({{'type': 'object', 'properties': ...}}); got {params!r:.200}")
        return cls(json.loads(json.dumps(schema)))


class BaseTool:
    """A veRL-style tool class. Subclass it and override any of the four methods (sync or async).

    `create(instance_id, **create_kwargs)` starts a per-trajectory state (the kwargs come from the
    row's `extra_info.tools_kwargs[name]["create_kwargs"]`); `execute(instance_id, parameters)` runs one
    call and returns `(text_or_response, step_reward, metrics)` (a bare text is fine too);
    `calc_reward(instance_id)` is the trajectory's tool reward; `release(instance_id)` frees the state.

    `tool_schema` is the OpenAI function schema (a dict, with attribute access like veRL's pydantic
    `OpenAIFunctionToolSchema`: `self.tool_schema.function.name`).
    """

    # Whether `execute` may get arguments the schema does not list (veRL passes them through).
    allow_extra_arguments = True

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.config = dict(config or {})
        schema = tool_schema if tool_schema is not None else self.get_openai_tool_schema()
        if schema is None:
            raise ToolSchemaError(f"{type(self).__name__}: no tool_schema; pass one (veRL's tool YAML "
                                  "`tool_schema:`) or override get_openai_tool_schema()")
        self.tool_schema = ToolSchema.wrap(schema, where=type(self).__name__)
        self.name: str = self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict | None:
        return getattr(self, "tool_schema", None)

    def create(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or str(uuid.uuid4())

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        raise NotImplementedError(f"{type(self).__name__}.execute")

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    def release(self, instance_id: str, **kwargs) -> None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FunctionTool(BaseTool):
    """A typed Python function as a tool. It keeps no state; its return value becomes the tool text
    (a str as is, anything else as JSON-ish `str()`); return a `ToolResult` to set a step reward."""

    allow_extra_arguments = False

    def __init__(self, fn: Callable, name: str | None = None):
        self.fn = fn
        super().__init__({}, function_schema(fn, name))

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        result = self.fn(**parameters)
        if isinstance(result, ToolResult):
            return result.text, result.reward, {}
        return (result if isinstance(result, str) else _to_text(result)), 0.0, {}


def _to_text(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def function_tool(fn: Callable, name: str | None = None) -> BaseTool:
    """Wraps a typed Python function as a tool; its schema comes from the signature and the Google-style
    docstring (the `Args:` lines become parameter descriptions). Async functions work too."""
    if isinstance(fn, BaseTool):
        return fn
    if not callable(fn):
        raise ToolSchemaError(f"function_tool({fn!r}): not callable; pass a function")
    if inspect.iscoroutinefunction(fn):
        return _AsyncFunctionTool(fn, name)
    return FunctionTool(fn, name)


class _AsyncFunctionTool(FunctionTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        result = await self.fn(**parameters)
        if isinstance(result, ToolResult):
            return result.text, result.reward, {}
        return (result if isinstance(result, str) else _to_text(result)), 0.0, {}


def check_call_arguments(tool: BaseTool, arguments: dict) -> tuple[dict, str | None]:
    """A call's arguments checked against `tool`'s schema: (arguments, None) or (arguments, message)."""
    parameters = tool.tool_schema["function"].get("parameters") or {}
    return check_arguments(tool.name, parameters, arguments, allow_extra=tool.allow_extra_arguments)


TRUNCATE_SIDES = ("left", "right", "middle")


def truncate_text(text: str, max_length: int, side: str = "middle") -> str:
    """Caps a tool response at `max_length` characters, as veRL's agent loop does.

    `side` says which part is KEPT: "left" keeps the start (`...(truncated)` after it), "right" keeps
    the end, "middle" keeps half from each end with `...(truncated)...` between them.
    """
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")


def response_text(response: Any) -> str:
    """The text of a veRL `execute()` response: a str, an object with `.text`, or a dict with "text"."""
    if response is None:
        return ""
    if isinstance(response, str):
        return response
    text = response.get("text") if isinstance(response, dict) else getattr(response, "text", response)
    return "" if text is None else str(text)


def unpack_execute(out: Any) -> tuple[str, float]:
    """(text, step reward) from `execute()`'s return: `(response, reward, metrics)`, `(response, reward)`
    or a bare response."""
    if isinstance(out, tuple):
        text = response_text(out[0]) if out else ""
        reward = out[1] if len(out) > 1 else 0.0
    else:
        text, reward = response_text(out), 0.0
    try:
        return text, float(reward or 0.0)
    except (TypeError, ValueError):
        raise TypeError(f"execute() returned reward {reward!r}; return (text, float reward, metrics)") from None
