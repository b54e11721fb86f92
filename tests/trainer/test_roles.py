"""Role handles (trainer/roles/handles.py): a proxy is its Protocol's methods, each call carried by name and checked
at the receiving end; over the host channel a one-way call goes without a reply and the others wait for theirs;
every role class has each method of its Protocol, with the Protocol's parameters. And the embedded Ray cluster's
settings: its workers (trainer processes, vLLM engines, reward workers) run at the driver's priority, not Ray's
default niceness 15, unless RAY_worker_niceness is set."""

import collections
import inspect

import pytest

from jaxrl_llm.ray_cluster import local_ray_config
from jaxrl_llm.trainer.processes import service as service_mod
from jaxrl_llm.trainer.processes.remote import RemoteEngine
from jaxrl_llm.trainer.processes.server import RolloutServer
from jaxrl_llm.trainer.processes.service import ChannelTransport, RolloutService
from jaxrl_llm.trainer.roles.engines import ColocatedEngine, SplitEngine
from jaxrl_llm.trainer.roles.handles import dispatch, proxy, role_methods, traced
from jaxrl_llm.trainer.roles.pool import PoolEngine
from jaxrl_llm.trainer.roles.protocols import EngineRole, StreamingEngine, WorkerRole
from jaxrl_llm.trainer.roles.worker import TrainerWorker


def test_an_embedded_cluster_runs_its_workers_at_the_drivers_priority(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    assert local_ray_config() == {"worker_niceness": 0}
    monkeypatch.setenv("RAY_worker_niceness", "10")  # the user's own setting: Ray reads it, we pass nothing
    assert local_ray_config() == {}


def test_a_proxy_is_its_protocols_methods_each_call_carried_by_name():
    sent = []
    worker = proxy(WorkerRole, lambda name, args, kwargs: sent.append((name, args, kwargs)) or len(sent))
    assert isinstance(worker, WorkerRole)
    assert worker.update_actor("batch", 3) == 1 and worker.start_forward_passes("b", old=True) == 2
    assert sent == [("update_actor", ("batch", 3), {}), ("start_forward_passes", ("b",), {"old": True})]
    assert type(worker).update_actor.__doc__ == WorkerRole.update_actor.__doc__  # a reader follows it there
    assert "update_actor" in role_methods(WorkerRole) and "generate" in role_methods(StreamingEngine)
    assert not hasattr(worker, "actor_state")  # nothing past the interface


def test_the_receiving_end_calls_only_the_protocols_methods():
    class Role:
        def update_actor(self, batch, step):
            return (batch, step)

        def _private(self):
            return "reached"

    assert dispatch(Role(), WorkerRole, "update_actor", ("b", 1), {}) == ("b", 1)
    for name in ("_private", "__init__", "actor_state"):
        with pytest.raises(AttributeError, match=f"WorkerRole has no method '{name}'"):
            dispatch(Role(), WorkerRole, name, (), {})


def test_a_traced_handle_reports_each_call():
    class Engine:
        def sync(self, version):
            return version

    seen = []
    engine = traced(Engine(), EngineRole, lambda name, s: seen.append((name, s >= 0)))
    assert engine.sync(4) == 4 and seen == [("sync", True)]


class FakeChannel:
    """Two ends of the host channel in one process: ordered messages by topic."""

    def __init__(self):
        self.topics = collections.defaultdict(collections.deque)

    def put(self, topic, obj):
        self.topics[topic].append(obj)

    def get(self, topic, **_):
        return self.topics[topic].popleft()


def test_over_the_channel_one_way_calls_go_without_a_reply_and_the_others_wait_for_theirs(monkeypatch):
    """The training side's proxy puts every call on "cmd"; the rollout process makes them in order (`serve`)
    on its server, replying only where the caller waits, and stops at `stop`."""
    channel = FakeChannel()
    made = []

    class Server:
        stopped = False

        def submit(self, prompts, metas, seed, streams, max_new_tokens_per_row, partial):
            made.append(("submit", prompts, seed))

        def busy(self):
            return 2.5

        def drain(self):
            made.append(("drain",))

        def stop(self):
            self.stopped = True

    monkeypatch.setattr(service_mod.distributed, "is_main", lambda: True)
    service = proxy(RolloutService, ChannelTransport(channel))
    channel.put("reply/busy", 2.5)  # the rollout side's replies, as `serve` below posts them again
    channel.put("reply/drain", None)
    assert service.submit([[1, 2]], [{}], 7, None, None, None) is None  # no reply read
    assert service.busy() == 2.5 and service.drain() is None
    service.stop()
    assert [c[0] for c in channel.topics["cmd"]] == ["submit", "busy", "drain", "stop"]
    service_mod.serve(Server(), channel)
    assert made == [("submit", [[1, 2]], 7), ("drain",)]
    assert list(channel.topics["reply/busy"]) == [2.5] and list(channel.topics["reply/drain"]) == [None]
    assert not channel.topics["reply/submit"] and not channel.topics["reply/stop"]


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("protocol, role", [
    (WorkerRole, TrainerWorker), (EngineRole, ColocatedEngine), (StreamingEngine, SplitEngine),
    (StreamingEngine, RemoteEngine), (EngineRole, PoolEngine), (RolloutService, RolloutServer),
])
def test_every_role_has_its_protocols_methods_with_their_parameters(protocol, role):
    for name in role_methods(protocol):
        assert _params(getattr(role, name)) == _params(getattr(protocol, name)), f"{role.__name__}.{name}"
