"""Role handles: a role's methods, called the same way wherever the role lives.

A role's interface is a Protocol (roles/protocols.py, processes/service.py). Its caller holds a handle typed as
that Protocol and calls methods on it: `worker.update_actor(batch, step)`. In this process the handle is the role
object itself. Elsewhere it is a proxy made from the Protocol (`proxy`), a class whose methods are the Protocol's
own (their names, signatures and docs), each of which hands its call to a transport and returns what the role's
method returned: `RayTransport` for a role in a Ray actor (the result is waited for, and the role's own error is
raised here), `ChannelTransport` (processes/remote.py) for one in another process of the run. The receiving end
calls the method through `dispatch`, which takes only the Protocol's methods. The method's name is the wire
format of one call and nothing else: no caller writes one, and a reader or a type checker follows every call
through the Protocol.

A method marked `@oneway` returns nothing its caller waits for: over a channel its call goes without a reply, so
the caller moves on at once (a prompt submitted, new weights about to cross).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")
Send = Callable[[str, tuple, dict], Any]


def oneway(method):
    """Marks a role method whose caller does not wait for it to finish (no reply crosses back)."""
    method.__oneway__ = True
    return method


def is_oneway(protocol: type, name: str) -> bool:
    return getattr(getattr(protocol, name), "__oneway__", False)


def role_methods(protocol: type) -> tuple[str, ...]:
    """The methods a role's Protocol declares (its own and those of the Protocols it extends), in order."""
    out: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or cls.__module__ == "typing":
            continue
        out.update((n, None) for n, v in vars(cls).items() if callable(v) and not n.startswith("_"))
    return tuple(out)


@functools.cache
def _proxy_class(protocol: type) -> type:
    def forward(name: str):
        @functools.wraps(getattr(protocol, name))
        def method(self, *args, **kwargs):
            return self._send(name, args, kwargs)

        return method

    def __init__(self, send: Send) -> None:
        self._send = send

    body = {name: forward(name) for name in role_methods(protocol)}
    body.update(__init__=__init__, __doc__=f"{protocol.__name__}, each call handed to a transport.")
    return type(f"{protocol.__name__}Proxy", (protocol,), body)


def proxy(protocol: type[R], send: Send) -> R:
    """An object of `protocol` whose every method calls `send(name, args, kwargs)` and returns its result."""
    return _proxy_class(protocol)(send)


def dispatch(role, protocol: type, name: str, args: tuple, kwargs: dict):
    """The receiving end of a proxy's call: `role`'s method `name`, which must be one of `protocol`'s."""
    if name not in role_methods(protocol):
        raise AttributeError(f"{protocol.__name__} has no method {name!r}")
    return getattr(role, name)(*args, **kwargs)


def traced(handle: R, protocol: type[R], on_call: Callable[[str, float], None]) -> R:
    """`handle`, with `on_call(method name, seconds)` after each call (a benchmark's progress lines)."""
    def send(name, args, kwargs):
        t0 = time.perf_counter()
        try:
            return getattr(handle, name)(*args, **kwargs)
        finally:
            on_call(name, time.perf_counter() - t0)

    return proxy(protocol, send)


class RayTransport:
    """Calls to a role hosted by a Ray actor (roles/host.py's `RoleHost`): each blocks on its result, and an error
    the role raised is raised here as itself."""

    def __init__(self, actor, role: str):
        self.actor, self.role = actor, role

    def __call__(self, name: str, args: tuple, kwargs: dict):
        import ray

        try:
            return ray.get(self.actor.serve.remote(self.role, name, args, kwargs))
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
