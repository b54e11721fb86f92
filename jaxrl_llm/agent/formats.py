"""Tool-call formats: how a model writes a call in an assistant turn, and the parser that finds them.

- "hermes" (Qwen2.5, Qwen3, Hermes): any number of
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` blocks in the turn. `arguments` may
  also be a JSON string holding the object. Calls inside a `<think>...</think>` block do not count.
- "llama3_json" (Llama 3.1 / 3.2 JSON tool calling): the whole message is `{"name": "f", "parameters":
  {...}}`, optionally after `<|python_tag|>`; several calls may be separated by `;`.

`parse(text)` returns the turn's calls in order (`[]` means the turn is a final answer). A call that
cannot be used (malformed JSON, no name, arguments that are not an object) is a `ToolCallError` whose
message tells the model how to fix it; the runner turns it into an error result. Choose the format with
`rollout.multi_turn.format`.
"""

from __future__ import annotations

import json
import re
from typing import Protocol

from jaxrl_llm.agent.tool_types import ToolCall, ToolCallError

# End-of-turn markers that may be left on decoded text; they are not part of a call.
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>")
_THINK_RE = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_HERMES_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


class ToolFormat(Protocol):
    """Finds the tool calls in an assistant turn's text."""

    name: str

    def parse(self, text: str) -> list[ToolCall | ToolCallError]: ...


def _strip_end(text: str) -> str:
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for marker in _END_MARKERS:
            if text.endswith(marker):
                text, changed = text[: -len(marker)].rstrip(), True
    return text


def _call_from_json(raw: str, args_keys: tuple[str, ...], example: str) -> ToolCall | ToolCallError:
    """One call from its JSON text; `args_keys` are the accepted names of the arguments field."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos}); "
                             f"write it as {example}", raw)
    if not isinstance(obj, dict):
        return ToolCallError(f"the tool call must be a JSON object, got {type(obj).__name__}; write it as "
                             f"{example}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError(f"the tool call has no \"name\" (a string); write it as {example}", raw)
    key = next((k for k in args_keys if k in obj), None)
    arguments = obj.get(key) if key else {}
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCallError(f"the \"{key}\" of the call to {name!r} is a string that is not valid JSON "
                                 f"({e.msg}); give a JSON object: {example}", raw)
    if not isinstance(arguments, dict):
        return ToolCallError(f"the \"{key}\" of the call to {name!r} must be a JSON object of named "
                             f"arguments, got {type(arguments).__name__}; write it as {example}", raw)
    return ToolCall(name=name.strip(), arguments=arguments)


class HermesFormat:
    """Qwen's `<tool_call>` blocks (see the module docstring)."""

    name = "hermes"
    example = '<tool_call>\n{"name": "tool_name", "arguments": {"arg": value}}\n</tool_call>'

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        text = _THINK_RE.sub("", _strip_end(text))
        calls: list[ToolCall | ToolCallError] = []
        for match in _HERMES_RE.finditer(text):
            body, closed = match.group(1).strip(), bool(match.group(2))
            if not body:
                calls.append(ToolCallError(f"an empty <tool_call> block; write a call as {self.example}",
                                           match.group(0)))
                continue
            call = _call_from_json(body, ("arguments", "parameters"), self.example)
            if isinstance(call, ToolCallError) and not closed:
                call = ToolCallError(f"a <tool_call> block is not closed with </tool_call> and its JSON does "
                                     f"not parse; write a call as {self.example}", match.group(0))
            calls.append(call)
        return calls


class Llama3JsonFormat:
    """Llama 3.1 / 3.2 JSON tool calls (see the module docstring)."""

    name = "llama3_json"
    example = '{"name": "tool_name", "parameters": {"arg": value}}'

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        text = _strip_end(text)
        tagged = text.startswith(_PYTHON_TAG)
        if tagged:
            text = text[len(_PYTHON_TAG):].strip()
        if not text.startswith("{"):
            if tagged:
                return [ToolCallError(f"after <|python_tag|> only a JSON call is understood; write it as "
                                      f"{self.example}", text)]
            return []
        return [_call_from_json(raw, ("parameters", "arguments"), self.example) for raw in _split_objects(text)]


def _split_objects(text: str) -> list[str]:
    """Splits `{...}; {...}` into its JSON objects (braces inside strings do not count); a tail that is
    not a complete object is kept as one piece so that its parse error is reported."""
    pieces, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                pieces.append(text[start:i + 1])
                rest = text[i + 1:].lstrip()
                if not rest.startswith(";"):
                    if rest:
                        pieces[-1] = text[start:]  # trailing junk: let the JSON error name it
                    return pieces
                start = i + 1 + (len(text[i + 1:]) - len(rest)) + 1
                while start < len(text) and text[start].isspace():
                    start += 1
    if start < len(text):
        pieces.append(text[start:])
    return pieces


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}


def get_format(name: str) -> ToolFormat:
    """The tool-call format called `name` (`rollout.multi_turn.format`)."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"rollout.multi_turn.format={name!r} is not a known tool-call format; use one of "
                         f"{sorted(FORMATS)} ('hermes' for Qwen2.5/Qwen3, 'llama3_json' for Llama 3.1/3.2)") from None
