"""Role handles: the driver calls a role's methods the same way whether it lives in this process or
in a Ray actor (`train.driver = "ray" | "inprocess"`)."""

from __future__ import annotations

import logging

from jaxrl_llm.ray_cluster import init_ray
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


def make_worker(run: RunConfig, *, total_steps: int, inprocess: bool = False):
    """The trainer worker (actor, reference, critic, JAX engine) as a role handle: in this process for
    `train.driver = 'inprocess'`, for `inprocess=True` and in every process of a multi-process run (each
    process owns its devices' part of the global mesh), else in a Ray actor."""
    from jaxrl_llm import distributed
    from jaxrl_llm.trainer.roles.worker import TrainerWorker

    if run.trainer.driver == "inprocess" or inprocess or distributed.process_count() > 1:
        return LocalRole(TrainerWorker(run, total_steps=total_steps))
    import ray

    init_ray(run.trainer.ray_address)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    actor_cls = ray.remote(num_gpus=gpus, num_cpus=1)(TrainerWorker)
    return RayRole(actor_cls.remote(run, total_steps=total_steps))
