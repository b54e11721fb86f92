"""The Ray driver's report when a run's processes fail: a death is named before the raises it causes."""

import os
import signal
import threading
import time

import pytest

from jaxrl_llm.distributed import DistributedError
from jaxrl_llm.trainer.processes.ray_driver import wait_all

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture
def processes():
    @ray.remote(num_cpus=0, max_restarts=0)
    class Process:
        def pid(self) -> int:
            return os.getpid()

        def fail(self):
            raise RuntimeError("a collective lost its peer")

        def run(self, seconds: float) -> int:
            time.sleep(seconds)
            return 0

    actors = [Process.remote(), Process.remote()]
    yield actors
    for a in actors:
        ray.kill(a)


def test_a_raise_that_reaches_the_driver_before_its_peers_death_reports_the_death(processes):
    # As in a killed run: process 0's collective raises as its peer goes; the raise reaches the driver first and
    # Ray's report of the death comes a moment later (here: process 1 is SIGKILLed a second after the raise).
    a, b = processes
    pid = ray.get(b.pid.remote())
    refs = [a.fail.remote(), b.run.remote(600)]
    ray.wait(refs[:1], timeout=60)
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(DistributedError, match=r"trainer process 1 of 2 died") as e:
            wait_all(refs)
    finally:
        killer.join()
    assert isinstance(e.value.__cause__, RuntimeError)


def test_a_raise_with_its_peers_alive_is_the_error_after_the_grace(processes):
    a, b = processes
    refs = [a.fail.remote(), b.run.remote(600)]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="a collective lost its peer"):
        wait_all(refs, death_grace_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 30


def test_processes_that_return_raise_nothing(processes):
    refs = [p.run.remote(0.1) for p in processes]
    wait_all(refs)
    assert ray.get(refs) == [0, 0]
