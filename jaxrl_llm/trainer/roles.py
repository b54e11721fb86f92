"""Role handles: the driver calls a role's methods the same way whether it lives in this process or
in a Ray actor (`train.driver = "ray" | "inprocess"`)."""

from __future__ import annotations

import logging
import os

from jaxrl_llm.trainer.config import RunConfig

log = logging.getLogger(__name__)


class LocalRole:
    """A role object in this process."""

    def __init__(self, obj):
        self.obj = obj

    def call(self, method: str, *args, **kwargs):
        return getattr(self.obj, method)(*args, **kwargs)

    def shutdown(self) -> None:
        pass


class RayRole:
    """A role in a Ray actor; `call` blocks on the result, and a remote error is re-raised here."""

    def __init__(self, actor):
        self.actor = actor

    def call(self, method: str, *args, **kwargs):
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs))
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor)


def init_ray(run: RunConfig) -> None:
    """Connects to `train.ray_address`, or starts an embedded local cluster."""
    import ray

    if ray.is_initialized():
        return
    if run.trainer.ray_address:
        ray.init(address=run.trainer.ray_address)
    else:
        ray.init(include_dashboard=False, log_to_driver=True, _system_config=local_ray_config())


def local_ray_config() -> dict:
    """An embedded cluster's settings. Ray starts its workers at niceness 15; ours are the run itself (trainer
    processes, vLLM engines, reward workers), and starved beside any other busy process one of them missed
    gloo's fixed 30 s rendezvous. They run at the driver's priority unless RAY_worker_niceness says otherwise."""
    return {} if "RAY_worker_niceness" in os.environ else {"worker_niceness": 0}


def make_worker(run: RunConfig, *, total_steps: int, inprocess: bool = False):
    """The trainer worker (actor, reference, critic, JAX engine) as a role handle: in this process for
    `train.driver = 'inprocess'`, for `inprocess=True` and in every process of a multi-process run (each
    process owns its devices' part of the global mesh), else in a Ray actor."""
    from jaxrl_llm import distributed
    from jaxrl_llm.trainer.worker import TrainerWorker

    if run.trainer.driver == "inprocess" or inprocess or distributed.process_count() > 1:
        return LocalRole(TrainerWorker(run, total_steps=total_steps))
    import ray

    init_ray(run)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    actor_cls = ray.remote(num_gpus=gpus, num_cpus=1)(TrainerWorker)
    return RayRole(actor_cls.remote(run, total_steps=total_steps))
