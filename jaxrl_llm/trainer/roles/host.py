"""Where the roles live: the worker and the engine a run needs, in this process or in a Ray actor, as handles.

`RoleHost` builds the roles that hold this process's devices: the worker (actor, reference, critic), and beside
it the JAX engine (roles/engines.py), which reads the actor's weights and, colocated, shares its devices. Under
`train.driver = 'ray'` a synchronous one-process run hosts them in one Ray actor (its GPU), and the driver holds
proxies of both (roles/handles.py); otherwise they live in this process (`train.driver = 'inprocess'`, every
process of a multi-process run, and every async run, whose rollouters drive the engine from threads of this
process), and the handles are the roles themselves. A vLLM pool is driven from the driver's process 0 either way
(roles/pool.py), writing its weights through the worker's handle.
"""

from __future__ import annotations

from jaxrl_llm import distributed
from jaxrl_llm.ray_cluster import init_ray
from jaxrl_llm.trainer.config import RunConfig
from jaxrl_llm.trainer.roles.engines import JaxEngineRole, make_engine
from jaxrl_llm.trainer.roles.handles import RayTransport, dispatch, proxy
from jaxrl_llm.trainer.roles.pool import PoolEngine
from jaxrl_llm.trainer.roles.protocols import EngineRole, WorkerRole
from jaxrl_llm.trainer.roles.worker import TrainerWorker

ROLES = {"worker": WorkerRole, "engine": EngineRole}


class RoleHost:
    """The roles on this process's devices. As a Ray actor's body, `serve` makes its proxies' calls."""

    def __init__(self, run: RunConfig, *, total_steps: int):
        self.worker = TrainerWorker(run, total_steps=total_steps)  # its programs compile ahead while ...
        self.engine = None
        if run.rollout.engine == "jax":  # ... the engine is built beside it, and builds its own programs
            self.engine = make_engine(self.worker)
            if self.worker.compiles_ahead and isinstance(self.engine, JaxEngineRole):
                self.engine.warm(run)
        self.worker.finish_compile_ahead()

    def serve(self, role: str, method: str, args: tuple, kwargs: dict):
        return dispatch(getattr(self, role), ROLES[role], method, args, kwargs)


def hosted_here(run: RunConfig) -> bool:
    """Whether the roles live in this process (else in a Ray actor): see the module docstring."""
    return run.trainer.driver == "inprocess" or run.async_training.enabled or distributed.process_count() > 1


def make_roles(run: RunConfig, *, total_steps: int) -> tuple[WorkerRole, EngineRole]:
    """Handles to the run's worker and engine (`total_steps` sizes the LR schedule)."""
    if hosted_here(run):
        host = RoleHost(run, total_steps=total_steps)
        worker, engine = host.worker, host.engine
    else:
        import ray

        init_ray(run.trainer.ray_address)
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        actor = ray.remote(num_gpus=gpus, num_cpus=1)(RoleHost).remote(run, total_steps=total_steps)
        worker = proxy(WorkerRole, RayTransport(actor, "worker"))
        engine = proxy(EngineRole, RayTransport(actor, "engine")) if run.rollout.engine == "jax" else None
    if run.rollout.engine == "vllm":
        engine = PoolEngine(run, worker)
    return worker, engine
