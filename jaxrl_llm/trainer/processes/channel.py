"""Host messages between the two sides of an async run over several processes: the trainer's commands to the rollout
process (prompts to generate, a sync about to start), and what comes back (finished samples, replies).

They go through the key-value store of `jax.distributed`'s coordination service, which every process of the run
already reaches, so neither the launcher nor Ray needs another transport. They are small (prompt ids, sampled
tokens and log-probs); weights never go this way (rollout/union_copy.py). Each topic is an ordered sequence of
keys `<topic>/<i>`; a key is deleted once every reader of its topic has read it (`readers`: the training
processes, which all read the rollout side's messages so that their SPMD loops see the same samples).
A failure on either side is posted under one key, and every wait checks it.
"""

from __future__ import annotations

import collections
import pickle
import threading
import time

from jaxrl_llm import distributed
from jaxrl_llm.distributed import DistributedError
from jaxrl_llm.rollout import RolloutError

POLL_MS = 500


class Channel:
    """Ordered, pickled messages by topic. `readers`: how many processes read each message this process reads (the
    training side's count on that side: each of them reads every reply and group; 1 on the rollout side)."""

    def __init__(self, name: str = "async", *, readers: int = 1):
        self.client = distributed.kv_client()
        self.prefix = f"jaxrl_llm/{name}"
        self.readers = readers
        self._sent: collections.Counter = collections.Counter()
        self._read: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self.bytes = 0

    def put(self, topic: str, obj) -> None:
        data = pickle.dumps(obj)
        with self._lock:
            i = self._sent[topic]
            self._sent[topic] += 1
            self.bytes += len(data)
        self.client.key_value_set_bytes(f"{self.prefix}/{topic}/{i}", data)

    def get(self, topic: str, *, stop=None, timeout_s: float | None = None):
        """The next message of `topic`, waiting for it; None when `stop()` turns true meanwhile. Raises the other
        side's failure (`fail`) as a RolloutError."""
        with self._lock:
            i = self._read[topic]
        key = f"{self.prefix}/{topic}/{i}"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # the wait timed out (DEADLINE_EXCEEDED); anything else is the service failing
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
            self.check()
            if stop is not None and stop():
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise RolloutError(f"no {topic} message from the other side within {timeout_s:.0f}s")
        with self._lock:
            self._read[topic] += 1
        self._consume(key, self.readers)
        return pickle.loads(data)

    def _consume(self, key: str, readers: int) -> None:
        if readers > 1 and self.client.key_value_increment(f"{key}/reads", 1) < readers:
            return
        self.client.key_value_delete(key)
        if readers > 1:
            self.client.key_value_delete(f"{key}/reads")

    def fail(self, message: str) -> None:
        """Tells the other side this one failed (its next wait raises `message`)."""
        self.client.key_value_set(f"{self.prefix}/error", message, allow_overwrite=True)

    def check(self) -> None:
        """Raises the other side's failure (`fail`) as a RolloutError; returns when there is none (the error key is
        NOT_FOUND). Any other failure of the store (the coordinator gone, a refused connection) raises
        DistributedError: it must not read as "the other side is fine"."""
        key = f"{self.prefix}/error"
        try:
            message = self.client.key_value_try_get(key)
        except Exception as e:  # jax raises JaxRuntimeError for every status; only NOT_FOUND means "no failure"
            if str(e).startswith("NOT_FOUND"):
                return
            raise DistributedError(f"the coordination service's key-value store failed reading {key!r} (is the "
                                   f"coordinator process still alive?): {type(e).__name__}: {e}") from e
        raise RolloutError(message)
