"""Tools an agent can call: typed Python functions or veRL-style tool classes, veRL's tool YAML, and
the runner that executes a turn's calls concurrently with a timeout each.

A typed function is a tool (its schema comes from the signature and docstring):

    def multiply(a: int, b: int) -> int:
        '''Multiplies two integers.

        Args:
          a: the first factor.
          b: the second factor.
        '''
        return a * b

    runner = ToolRunner([multiply], max_parallel_calls=2, timeout_s=5.0)
    session = runner.open(row["extra_info"].get("tools_kwargs"))
    results = session.call(get_format("hermes").parse(assistant_text))   # [ToolResult]

A class with veRL's `BaseTool` methods (`create` / `execute` / `calc_reward` / `release`, each sync or
async) is listed in veRL's tool YAML and loaded with `load_tool_config(path)`:

    tools:
      - class_name: jaxrl_llm.agent.builtin_tools.Gsm8kTool
        config: {type: native}
        tool_schema: {type: function, function: {name: calc_gsm8k_reward, ...}}

`session.call` never raises for a tool's fault: malformed calls, unknown tools, bad arguments, a tool
that raises or runs past its timeout come back as a `ToolResult` with `error` set and a `text` telling
the model what went wrong; `session.metrics` counts them.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from jaxrl_llm.agent.tool_runner import ToolRunner, ToolSession
from jaxrl_llm.agent.tool_schema import ToolSchemaError, check_arguments, function_schema
from jaxrl_llm.agent.tool_types import (
    ERROR_KINDS,
    TRUNCATE_SIDES,
    BaseTool,
    FunctionTool,
    ToolCall,
    ToolCallError,
    ToolResult,
    ToolSchema,
    function_tool,
    truncate_text,
)

__all__ = ["ERROR_KINDS", "TRUNCATE_SIDES", "BaseTool", "FunctionTool", "ToolCall", "ToolCallError",
           "ToolConfigError", "ToolResult", "ToolRunner", "ToolSchema", "ToolSchemaError", "ToolSession",
           "check_arguments", "function_schema", "function_tool", "load_tool_config", "truncate_text"]

# veRL's class paths for tools we ship, so that a tool YAML copied from veRL loads as is.
VERL_CLASS_ALIASES = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "jaxrl_llm.agent.builtin_tools.Gsm8kTool",
}


class ToolConfigError(ValueError):
    """A tool YAML that cannot be loaded; the message names the file and the entry."""


def _import_object(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted path (package.module.Class)")
    return getattr(importlib.import_module(module_name), attr)


def _entry_tool(entry: Any, where: str) -> BaseTool:
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: each entry of `tools:` must be a mapping with class_name, config "
                              f"and tool_schema; got {entry!r:.200}")
    unknown = set(entry) - {"class_name", "config", "tool_schema"}
    if unknown:
        raise ToolConfigError(f"{where}: unknown key(s) {sorted(unknown)}; an entry has class_name, config "
                              "and tool_schema")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise ToolConfigError(f"{where}: no class_name; give the dotted path of a BaseTool subclass or a "
                              "typed function (e.g. jaxrl_llm.agent.builtin_tools.Gsm8kTool)")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where} ({class_name}): config must be a mapping, got {config!r:.200}")
    if config.get("type", "native") != "native":
        raise ToolConfigError(f"{where} ({class_name}): config.type={config['type']!r} is not supported; only "
                              "'native' tools (Python classes) run here (veRL's 'mcp' tools do not)")
    class_path = VERL_CLASS_ALIASES.get(class_name, class_name)
    try:
        obj = _import_object(class_path)
    except (ImportError, AttributeError) as e:
        raise ToolConfigError(f"{where}: cannot import class_name {class_name!r} ({type(e).__name__}: {e}); "
                              "check the dotted path and that its package is importable (PYTHONPATH)") from None
    schema = entry.get("tool_schema")
    try:
        if isinstance(obj, type):
            tool = obj(config=config, tool_schema=schema)
        elif callable(obj):
            tool = function_tool(obj, name=(schema or {}).get("function", {}).get("name") if schema else None)
            if schema is not None:  # the YAML's schema (descriptions) wins over the docstring's
                tool.tool_schema = ToolSchema.wrap(schema, where=where)
        else:
            raise ToolConfigError(f"{where}: {class_name!r} is neither a class nor a function")
    except ToolConfigError:
        raise
    except Exception as e:
        raise ToolConfigError(f"{where} ({class_name}): building the tool failed: {type(e).__name__}: {e}") from None
    if not isinstance(tool, BaseTool) and not all(
            callable(getattr(tool, m, None)) for m in ("create", "execute", "calc_reward", "release")):
        raise ToolConfigError(f"{where}: {class_name!r} does not have BaseTool's methods "
                              "(create, execute, calc_reward, release); subclass jaxrl_llm.agent.tools.BaseTool")
    if not isinstance(getattr(tool, "tool_schema", None), ToolSchema):
        tool.tool_schema = ToolSchema.wrap(getattr(tool, "tool_schema", None), where=f"{where} ({class_name})")
        tool.name = tool.tool_schema["function"]["name"]
    return tool


def yaml_entries(path: str, *, section: str, setting: str, expected: str, error: type[Exception]) -> list:
    """The non-empty list under `section:` of a YAML file (veRL's tool and interaction configs); one `error`
    naming `setting` or the file when it cannot be read, is not YAML, or has no such list."""
    try:
        import yaml
    except ImportError:
        raise error(f"{setting}: reading a YAML config needs the pyyaml package: pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise error(f"{setting}={path!r}: cannot read it ({e})") from None
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML ({e})") from None
    entries = doc.get(section) if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise error(f"{path}: needs a non-empty list under `{section}:` ({expected})")
    return entries


def load_tool_config(path: str) -> list[BaseTool]:
    """The tools of veRL's tool YAML (`rollout.multi_turn.tool_config_path`).

    The file holds `tools:`, a list of `{class_name, config, tool_schema}`. `class_name` is the dotted
    path of a `BaseTool` subclass (built as `Class(config=config, tool_schema=tool_schema)`) or of a
    typed function. veRL's own `verl.tools.gsm8k_tool.Gsm8kTool` maps to our `Gsm8kTool`.
    """
    path = os.path.expanduser(os.fspath(path))
    entries = yaml_entries(path, section="tools", setting="rollout.multi_turn.tool_config_path",
                           expected="veRL's tool config format: tools: [{class_name: ..., config: {...}, "
                                    "tool_schema: {...}}]", error=ToolConfigError)
    tools = []
    for i, entry in enumerate(entries):
        tools.append(_entry_tool(entry, f"{path}: tools[{i}]"))
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ToolConfigError(f"{path}: tool names {duplicates} appear more than once; names must be unique")
    return tools
