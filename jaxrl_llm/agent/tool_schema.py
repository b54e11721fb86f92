"""OpenAI function schemas for tools: built from a typed Python function, and used to check a call's
arguments before the tool runs.

The schema has the shape `tokenizer.apply_chat_template(..., tools=[...])` and veRL's tool YAML use:
`{"type": "function", "function": {"name", "description", "parameters": {"type": "object",
"properties": {...}, "required": [...]}}}`. `Optional[X]` is X with `"nullable": true`, `Literal[...]`
an `"enum"`, and a return annotation adds `"return"`.

The output equals `transformers.utils.get_json_schema` for the types both support (a test checks
it), so a function tool renders the same tokens here as in TRL.

`check_arguments` is a small JSON-schema subset (type, enum, items, required, nullable): enough to tell
the model which argument is wrong, in words it can act on, instead of a Python traceback.
"""

from __future__ import annotations

import collections.abc
import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object",
            list: "array", tuple: "array", type(None): "null", Any: None}
# A Google-style docstring section header ("Args:", "Returns:", ...).
_SECTION_RE = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_ARG_LINE_RE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


class ToolSchemaError(ValueError):
    """A function cannot be described as a tool (an untyped parameter, an unsupported type, ...)."""


def type_to_schema(hint: Any, where: str) -> dict:
    """JSON schema of one type hint; `where` names the parameter in errors."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint in _SCALARS:
        kind = _SCALARS[hint]
        return {} if kind is None else {"type": kind}
    if origin is Literal:
        kinds = {_SCALARS.get(type(a)) for a in args}
        schema: dict = {"type": kinds.pop()} if len(kinds) == 1 and None not in kinds else {}
        schema["enum"] = list(args)
        return schema
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        nullable = len(members) < len(args)
        if len(members) == 1:
            schema = dict(type_to_schema(members[0], where))
        else:
            schema = {"anyOf": [type_to_schema(m, where) for m in members]}
        if nullable:
            schema["nullable"] = True
        return schema
    if origin in (list, tuple, collections.abc.Sequence):
        schema = {"type": "array"}
        if args:
            schema["items"] = type_to_schema(args[0], where)
        return schema
    if origin is dict:
        return {"type": "object"}
    raise ToolSchemaError(f"{where}: type {hint!r} has no JSON schema; use int, float, str, bool, "
                          "list[...], dict, Optional[...] or Literal[...]")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str], str]:
    """(description, {argument: description}, returns) from a Google-style docstring.

    The description is the text before the first section (paragraphs kept); argument lines under
    `Args:` are `name: text` or `name (type): text`, and indented lines below one continue it.
    """
    if not doc:
        return "", {}, ""
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    returns: list[str] = []
    arg_docs: dict[str, str] = {}
    section = None
    current = None
    arg_indent = None
    for line in lines:
        header = _SECTION_RE.match(line)
        if header:
            section = header.group(1)
            current = arg_indent = None
            continue
        if section is None:
            description.append(line)
        elif section == "Returns":
            returns.append(line.strip())
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            indent = len(line) - len(line.lstrip())
            match = _ARG_LINE_RE.match(line)
            if match and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = match.group(1).lstrip("*")
                arg_docs[current] = match.group(2).strip()
            elif current is not None:
                arg_docs[current] = f"{arg_docs[current]} {line.strip()}".strip()
    return "\n".join(description).strip(), arg_docs, " ".join(r for r in returns if r)


def function_schema(fn: Callable, name: str | None = None) -> dict:
    """The OpenAI function schema of `fn` from its signature and docstring.

    Every parameter needs a type hint; those without a default are `required`. `*args`/`**kwargs`
    are not allowed (a model cannot fill them meaningfully).
    """
    tool_name = name or getattr(fn, "__name__", None)
    if not tool_name or not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", tool_name):
        raise ToolSchemaError(f"tool name {tool_name!r}: use 1-64 letters, digits, '_' or '-' (pass name=...)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve, ...
        raise ToolSchemaError(f"tool {tool_name!r}: cannot resolve its type hints ({e})") from None
    description, arg_docs, returns_doc = parse_docstring(inspect.getdoc(fn))
    properties: dict[str, dict] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolSchemaError(f"tool {tool_name!r}: parameter {param}: *args/**kwargs cannot be a tool "
                                  "parameter; name each argument")
        if pname not in hints:
            raise ToolSchemaError(f"tool {tool_name!r}: parameter {pname!r} has no type hint; annotate it "
                                  "(int, float, str, bool, list[...], Optional[...], Literal[...])")
        prop = type_to_schema(hints[pname], f"tool {tool_name!r} parameter {pname!r}")
        if pname in arg_docs and arg_docs[pname]:
            prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    parameters: dict = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function = {"name": tool_name, "description": description or tool_name, "parameters": parameters}
    if "return" in hints:  # as transformers.utils.get_json_schema, so the tool renders the same tokens
        function["return"] = type_to_schema(hints["return"], f"tool {tool_name!r} return value")
        if returns_doc:
            function["return"]["description"] = returns_doc
    return {"type": "function", "function": function}


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "array": list, "object": dict,
                              "null": type(None)}.get(kind, object))


def _check_value(schema: dict, value: Any, where: str) -> tuple[Any, str | None]:
    """(value, None) if `value` fits `schema`, else (value, message). Lossless fixes are made: an
    integral float becomes an int for "integer", a number becomes a string for "string"."""
    if value is None and schema.get("nullable"):
        return value, None
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            fixed, problem = _check_value(option, value, where)
            if problem is None:
                return fixed, None
        return value, f"{where} has the wrong type: got {type(value).__name__} {value!r:.80}"
    if "enum" in schema and value not in schema["enum"]:
        return value, f"{where} must be one of {schema['enum']}, got {value!r:.80}"
    kinds = schema.get("type")
    if kinds is None:
        return value, None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if "integer" in kinds and isinstance(value, float) and value.is_integer():
        value = int(value)
    if kinds == ["string"] and isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)  # models often write {"answer": 72} for a string parameter
    if not any(_type_ok(k, value) for k in kinds):
        want = " or ".join(kinds)
        return value, f"{where} must be {want}, got {type(value).__name__} {value!r:.80}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        fixed_items = []
        for i, item in enumerate(value):
            fixed, problem = _check_value(schema["items"], item, f"{where}[{i}]")
            if problem:
                return value, problem
            fixed_items.append(fixed)
        value = fixed_items
    return value, None


def check_arguments(tool_name: str, parameters: dict, arguments: dict, *,
                    allow_extra: bool) -> tuple[dict, str | None]:
    """Checks a call's arguments against the tool's `parameters` schema.

    Returns (arguments, None) when they fit (integral floats for integer parameters turned into ints),
    else (arguments, a message for the model naming the argument). `allow_extra=False` refuses
    arguments the schema does not list (a Python function cannot take them).
    """
    properties = parameters.get("properties") or {}
    missing = [p for p in parameters.get("required") or () if p not in arguments]
    if missing:
        return arguments, (f"tool {tool_name!r} is missing required argument(s) {missing}; "
                           f"its parameters are {sorted(properties)}")
    extra = [a for a in arguments if a not in properties]
    if extra and (not allow_extra or parameters.get("additionalProperties") is False):
        return arguments, (f"tool {tool_name!r} got unexpected argument(s) {extra}; "
                           f"its parameters are {sorted(properties)}")
    fixed = dict(arguments)
    for key, value in arguments.items():
        if key in properties:
            fixed[key], problem = _check_value(properties[key], value, f"argument {key!r} of tool {tool_name!r}")
            if problem:
                return arguments, problem
    return fixed, None
