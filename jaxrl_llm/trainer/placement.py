"""Which devices train and which generate: all of them do both in order (`async_training.mode = 'sync'`), or
they split into a training mesh and a rollout mesh on disjoint devices (one_step_off, fully_async).

In one process the training devices come first: `train.n_gpus_per_node` x `train.nnodes` of them (default: all
the rollout does not take), then `rollout.n_gpus_per_node` x `rollout.nnodes` for the rollout, whose mesh splits
each shard's heads over `rollout.tensor_model_parallel_size` devices and runs the rest data-parallel.
"""

from __future__ import annotations

import jax

from jaxrl_llm import distributed, sharding
from jaxrl_llm.errors import ConfigValueError


def split_devices(run) -> tuple[list, list | None]:
    """(training devices, rollout devices or None when they are the same)."""
    devices = jax.devices()
    t, r = run.trainer, run.rollout
    if not run.async_training.enabled:
        n = (t.n_gpus_per_node or 0) * t.nnodes
        if n and distributed.process_count() == 1:
            if n > len(devices):
                raise ConfigValueError(f"train.n_gpus_per_node x train.nnodes = {n}: this process has {len(devices)} "
                                       "devices; lower them, or None for every device")
            return devices[:n], None
        return devices, None
    mode = run.async_training.mode
    if distributed.process_count() > 1:
        raise ConfigValueError(f"async_training.mode = {mode!r} runs in one process (a rollout mesh and a training "
                               "mesh on its devices); several processes are not supported yet: set "
                               "train.num_processes = 1, or async_training.mode = 'sync'")
    n_roll = r.n_gpus_per_node * r.nnodes
    n_train = t.n_gpus_per_node * t.nnodes if t.n_gpus_per_node else len(devices) - n_roll
    if n_roll < 1 or n_train < 1 or n_roll + n_train > len(devices):
        raise ConfigValueError(
            f"async_training.mode = {mode!r}: rollout.n_gpus_per_node x rollout.nnodes = {n_roll} and "
            f"train.n_gpus_per_node x train.nnodes = {n_train} devices must each be >= 1 and fit the {len(devices)} "
            "devices of this process; set rollout.n_gpus_per_node (and train.n_gpus_per_node, or leave it None "
            "for the rest)")
    if n_roll % r.tensor_model_parallel_size:
        raise ConfigValueError(f"rollout.tensor_model_parallel_size = {r.tensor_model_parallel_size} does not divide "
                               f"the rollout's {n_roll} devices (rollout.n_gpus_per_node x rollout.nnodes)")
    return devices[:n_train], devices[n_train:n_train + n_roll]


def rollout_mesh(run, devices: list):
    """The rollout's own mesh: data-parallel shards of `rollout.tensor_model_parallel_size` devices each."""
    return sharding.make_mesh(1, -1, run.rollout.tensor_model_parallel_size, devices=devices)
