"""The Ray cluster a run uses, for every floor that starts Ray actors (the trainer's roles and processes, the
reward manager's workers): connecting to `train.ray_address` or starting an embedded local cluster, and that
cluster's settings. Below trainer/ and rewards/, so neither imports the other for it."""

from __future__ import annotations

import os


def local_ray_config() -> dict:
    """An embedded cluster's settings. Ray starts its workers at niceness 15; ours are the run itself (trainer
    processes, vLLM engines, reward workers), and starved beside any other busy process one of them missed
    gloo's fixed 30 s rendezvous. They run at the driver's priority unless RAY_worker_niceness says otherwise."""
    return {} if "RAY_worker_niceness" in os.environ else {"worker_niceness": 0}


def init_ray(address: str | None = None) -> None:
    """Connects to the cluster at `address` (`train.ray_address`), or starts an embedded local one; nothing when
    this process is connected already."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        ray.init(include_dashboard=False, log_to_driver=True, _system_config=local_ray_config())
