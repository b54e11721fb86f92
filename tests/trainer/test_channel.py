"""The async run's host channel (trainer/processes/channel.py) over a stand-in for the coordination service's
key-value store: only a missing error key reads as "no failure"; any other failure of the store raises."""

import pytest

from jaxrl_llm.distributed import DistributedError
from jaxrl_llm.rollout import RolloutError
from jaxrl_llm.trainer.processes import channel as channel_mod

# The statuses jax's client raises (JaxRuntimeError, a RuntimeError), as they read on jax 0.10.2.
NOT_FOUND = ("NOT_FOUND: Config key jaxrl_llm/async/error not found.\nAdditional GRPC error information from "
             "remote target coordination_service while calling /xla.coordination.CoordinationService/TryGetKeyValue")
UNAVAILABLE = "UNAVAILABLE: failed to connect to all addresses; last error: Connection refused"


class FakeStore:
    """A key-value store: `raises` (a message) makes every read fail with it, as a dead coordinator does."""

    def __init__(self, raises: str | None = None):
        self.data, self.raises = {}, raises

    def key_value_set(self, key, value, allow_overwrite=False):
        self.data[key] = value

    def key_value_try_get(self, key):
        if self.raises is not None:
            raise RuntimeError(self.raises)
        if key not in self.data:
            raise RuntimeError(NOT_FOUND)
        return self.data[key]


def channel(monkeypatch, store: FakeStore) -> channel_mod.Channel:
    monkeypatch.setattr(channel_mod.distributed, "kv_client", lambda: store)
    return channel_mod.Channel()


def test_no_error_key_is_no_failure_and_a_posted_failure_raises(monkeypatch):
    ch = channel(monkeypatch, FakeStore())
    ch.check()
    ch.fail("the rollout process died at step 3")
    with pytest.raises(RolloutError, match="died at step 3"):
        ch.check()


def test_a_failing_store_raises_instead_of_reading_as_no_failure(monkeypatch):
    ch = channel(monkeypatch, FakeStore(raises=UNAVAILABLE))
    with pytest.raises(DistributedError, match="key-value store failed reading 'jaxrl_llm/async/error'.*UNAVAILABLE"):
        ch.check()
