"""Which devices train and which generate: all of them do both in order (`async_training.mode = 'sync'`), or
they split into a training mesh and a rollout mesh on disjoint devices (one_step_off, fully_async).

In one process the training devices come first: `train.n_gpus_per_node` x `train.nnodes` of them (default: all
the rollout does not take), then `rollout.n_gpus_per_node` x `rollout.nnodes` for the rollout, whose mesh splits
each shard's heads over `rollout.tensor_model_parallel_size` devices and runs the rest data-parallel.

Over several processes (the plain launcher or the Ray driver, which place them the same way: process i gets the
i-th block of devices) a node is a process, and each process is one side: the first `train.nnodes` processes
train (their devices are the training mesh), the next `rollout.nnodes` generate (the rollout mesh). Every process
holds `n_gpus_per_node` devices of its side, the same count on both sides. The two sides are one `jax.distributed`
cluster: each runs its own SPMD programs (`distributed.set_group`), and the weight sync is one program over
devices of both (rollout/weight_sync.py, `side`). NOTES.md item 41 says why processes do not mix the sides.
"""

from __future__ import annotations

import jax

from jaxrl_llm import distributed, sharding
from jaxrl_llm.errors import ConfigValueError

TRAIN, ROLLOUT = "train", "rollout"


def check_processes(run, num_processes: int, devices_per_process: int | None = None) -> None:
    """Refuses, before any process starts, a split of an async run over `num_processes` processes (of
    `devices_per_process` devices each, when known) that cannot work: one error naming the keys."""
    a, t, r = run.async_training, run.trainer, run.rollout
    if not a.enabled or num_processes <= 1:
        return
    where = f"async_training.mode = {a.mode!r} over {num_processes} processes"
    if t.nnodes + r.nnodes != num_processes:
        raise ConfigValueError(
            f"{where}: a process is one node of one side, so train.nnodes ({t.nnodes}) + rollout.nnodes "
            f"({r.nnodes}) must be {num_processes}; set them (the first train.nnodes processes train, the others "
            "generate)")
    if r.nnodes != 1:
        raise ConfigValueError(f"{where}: rollout.nnodes = {r.nnodes}; the rollout side runs in one process yet "
                               "(its stream drives that process's shards): set rollout.nnodes = 1 and give it "
                               "rollout.n_gpus_per_node devices")
    n_train = t.n_gpus_per_node or r.n_gpus_per_node
    if n_train != r.n_gpus_per_node:
        raise ConfigValueError(f"{where}: train.n_gpus_per_node ({n_train}) and rollout.n_gpus_per_node "
                               f"({r.n_gpus_per_node}) differ; the launcher and Ray give every process the same "
                               "device count, so make them equal")
    if devices_per_process is not None and devices_per_process != n_train:
        raise ConfigValueError(f"{where}: each process has {devices_per_process} devices but train.n_gpus_per_node "
                               f"and rollout.n_gpus_per_node say {n_train}; make them agree (--gpus_per_process / "
                               "--devices_per_process, or train.devices_per_process under Ray)")
    if r.n_gpus_per_node % r.tensor_model_parallel_size:
        raise ConfigValueError(f"rollout.tensor_model_parallel_size = {r.tensor_model_parallel_size} does not divide "
                               f"the rollout's {r.n_gpus_per_node} devices (rollout.n_gpus_per_node)")


def side(run) -> str | None:
    """This process's side in an async run over several processes ('train' or 'rollout'); None otherwise (one
    process, or a synchronous run: every process does everything)."""
    if not run.async_training.enabled or jax.process_count() == 1:
        return None
    return TRAIN if jax.process_index() < run.trainer.nnodes else ROLLOUT


def enter_side(run) -> str | None:
    """Checks the split against the processes and their devices, and scopes `distributed` to this process's side;
    returns the side (None: one process, or sync)."""
    if not run.async_training.enabled or jax.process_count() == 1:
        return None
    check_processes(run, jax.process_count(), jax.local_device_count())
    me = side(run)
    n_train = run.trainer.nnodes
    distributed.set_group(range(n_train) if me == TRAIN else range(n_train, jax.process_count()))
    return me


def _by_process(devices: list) -> list:
    return sorted(devices, key=lambda d: (d.process_index, d.id))


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
    if jax.process_count() > 1:  # a side per process: the training processes' devices, then the rollout's
        check_processes(run, jax.process_count(), jax.local_device_count())
        ordered = _by_process(devices)
        train = [d for d in ordered if d.process_index < t.nnodes]
        return train, [d for d in ordered if d.process_index >= t.nnodes]
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
