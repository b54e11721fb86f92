"""`train.driver = 'ray'` with `train.num_processes > 1`: the run's processes as Ray actors.

The driver reserves one placement-group bundle per process (its GPUs, or one CPU with `train.devices_per_process`
simulated CPU devices), spread over the nodes of the cluster, starts a `TrainProcess` actor in each, and hands every
actor the address of process 0's coordinator. Each actor then does what a plainly launched process does
(`jaxrl_llm.trainer.processes.process.run_process`): joins the others with `jax.distributed`, and runs the whole RL loop
as one process of the SPMD program.

An async run's processes are placed as the plain launcher places them: bundle i is process i, the first
`train.nnodes` train and the rest generate (trainer/processes/placement.py).

The driver only waits. When a process fails or dies, it stops the others and raises one error; the
next start resumes from the last checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import socket

from jaxrl_llm.distributed import DistributedError, ProcessSpec
from jaxrl_llm.ray_cluster import init_ray
from jaxrl_llm.trainer.config import RunConfig
from jaxrl_llm.trainer.processes.placement import check_processes

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120
DEATH_GRACE_S = 15.0  # how long a raise waits to learn whether a peer's death caused it (`wait_all`)


class TrainProcess:
    """One process of a multi-process run (the body of a Ray actor)."""

    def address(self) -> str:
        """HOST:PORT for a coordinator on this node (a port free now)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def pid(self) -> int:
        return os.getpid()

    def fit(self, run: RunConfig, operative_config: str, spec: ProcessSpec, log_level: str = "INFO") -> dict:
        from jaxrl_llm.trainer.processes.process import run_process, setup_logging

        setup_logging(log_level, spec.process_id)
        return run_process(run, operative_config, spec)


def _env_for(devices: int, gpu: bool) -> dict[str, str]:
    """The environment of an actor, set before its JAX starts: the simulated CPU device count."""
    env = {}
    if os.environ.get("JAX_PLATFORMS"):
        env["JAX_PLATFORMS"] = os.environ["JAX_PLATFORMS"]
    if not gpu:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def fit_on_ray(run: RunConfig, operative_config: str, *, log_level: str = "INFO") -> dict:
    """Runs the training as `train.num_processes` Ray actors; returns process 0's last metrics."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    t = run.trainer
    n, per = t.num_processes, t.devices_per_process or 1
    check_processes(run, n, per)  # an async run: training processes first, then the rollout's (as the launcher)
    init_ray(run.trainer.ray_address)
    gpu = ray.cluster_resources().get("GPU", 0) > 0
    bundle = {"CPU": 1, "GPU": per} if gpu else {"CPU": 1}
    # SPREAD: one process per node where the cluster has the nodes (JAX's usual layout), else packed.
    pg = placement_group([bundle] * n, strategy="SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise DistributedError(f"Ray could not place {n} trainer processes of {bundle} each within "
                               f"{PLACEMENT_TIMEOUT_S}s; the cluster has {ray.cluster_resources()}. Lower "
                               "train.num_processes / train.devices_per_process, or add nodes")
    actor_cls = ray.remote(TrainProcess)
    actors = [actor_cls.options(
        num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        runtime_env={"env_vars": _env_for(per, gpu)}).remote() for i in range(n)]
    try:
        coordinator = ray.get(actors[0].address.remote())
        log.info("starting %d trainer processes (%s each), coordinator %s", n, bundle, coordinator)
        refs = [a.fit.remote(run, operative_config, ProcessSpec(coordinator, n, i), log_level)
                for i, a in enumerate(actors)]
        wait_all(refs)
        return ray.get(refs[0])
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)


def wait_all(refs: list, death_grace_s: float = DEATH_GRACE_S) -> None:
    """Waits for every process; raises the first failure, but a death before a raise.

    A process that dies takes its peers down with it: a collective or the coordination service fails in each of
    them, often before Ray has told the driver of the death. So when a process raises, the others get
    `death_grace_s` to finish, and a death among them is the error reported (the raise is its symptom)."""
    import ray

    n = len(refs)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            try:
                death = _death_of(ref, refs.index(ref), n)
            except BaseException as raised:
                death = _a_death(refs, pending, death_grace_s)
                if death is None:
                    raise
                raise death from raised
            if death is not None:
                raise death


def _a_death(refs: list, pending: list, timeout_s: float) -> DistributedError | None:
    """The first of `pending` found dead within `timeout_s` (those that return or raise are passed over)."""
    import time

    import ray

    t_end = time.monotonic() + timeout_s
    while pending and (left := t_end - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                death = _death_of(ref, refs.index(ref), len(refs))
            except BaseException:  # noqa: BLE001 - another symptom; the first raise stays the error
                continue
            if death is not None:
                return death
    return None


def _death_of(ref, index: int, n: int) -> DistributedError | None:
    """A finished process: its death as the error to raise, None if it returned; its own raise, unwrapped."""
    import ray

    try:
        ray.get(ref)
    except ray.exceptions.RayTaskError as e:  # the process raised: its own error, unwrapped
        raise e.as_instanceof_cause() from None
    except ray.exceptions.RayActorError as e:  # the process died (killed, out of memory, a crash)
        cause = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        return DistributedError(f"trainer process {index} of {n} died ({cause}); the other processes were "
                                "stopped. Rerun the same command to resume from the last checkpoint")
    return None
