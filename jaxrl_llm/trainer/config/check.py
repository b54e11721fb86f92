"""The checks every run-config part uses: one error type that names the gin binding, and the type check
of bound values (gin binds whatever the user wrote; a wrong type should fail naming its binding)."""

from __future__ import annotations

import dataclasses
import types
import typing

from jaxrl_llm.errors import ConfigValueError


def check(cond: bool, binding: str, msg: str) -> None:
    if not cond:
        raise ConfigValueError(f"{binding}: {msg}")


def type_ok(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(type_ok(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is tuple or origin is tuple:
        return isinstance(value, tuple | list)  # gin writes lists for tuple fields too
    return isinstance(value, origin or hint)


def check_types(part, name: str) -> None:
    """A bound value of the wrong type fails here, naming its binding, not later inside a comparison."""
    hints = typing.get_type_hints(type(part))
    for field in dataclasses.fields(part):
        value = getattr(part, field.name)
        check(type_ok(value, hints[field.name]), f"{name}.{field.name}",
               f"{value!r} is a {type(value).__name__}; expected {field.type}")
