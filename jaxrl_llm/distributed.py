"""Several JAX processes as one program: joining them, and moving values between host and devices.

A run may span several processes (one per host, or one per GPU), joined by `jax.distributed` into one
global device mesh. Every process runs the same Python code and the same jitted programs in the same
order (multi-controller SPMD), so every host-side decision must be made from values that are equal on
all processes. The helpers here keep that true:

* `put(x, sharding)` places a host array that every process holds in full (the same value) as a
  global array; each process writes only its own devices' shards.
* `fetch(x)` returns the global value of a device array on every process (an all-gather across
  processes when the array spans devices of other processes; a plain copy otherwise).
* `allgather_host(x)` stacks a host array from every process ([P, ...]); `is_main()` says whether this
  process logs and writes the run's files.

With one process every helper reduces to the plain single-process call.

*Groups.* An asynchronous run over several processes (trainer/processes/placement.py) splits them into training
processes and rollout processes, each side one SPMD program of its own. `set_group(processes)` scopes these helpers to
this process's side: `process_count`, `process_index`, `is_main`, `share`, the gathers and the barrier then involve that
side's processes only (a collective over every process would wait forever for the other side, which runs other
programs). Both sides stay in one `jax.distributed` cluster, so a program over devices of both (the weight sync) and the
coordination service's key-value store (`kv_*`) still reach everything.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np

log = logging.getLogger(__name__)

# Environment variables of the plain launcher (and of any SLURM / mpirun wrapper that sets them).
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"


class DistributedError(RuntimeError):
    """The processes of a run could not be joined (bad flags, no coordinator)."""


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where this process sits in a multi-process run."""

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: tuple[int, ...] | None = None

    @property
    def multi(self) -> bool:
        return self.num_processes > 1


def spec_from_env(coordinator_address: str | None = None, num_processes: int | None = None,
                  process_id: int | None = None, local_device_ids: str | None = None) -> ProcessSpec:
    """The process spec from explicit values (command-line flags), else the launcher's environment
    variables, else SLURM's (`SLURM_NTASKS`, `SLURM_PROCID`, with the coordinator on the first node
    left to JAX's cluster detection). One process when none of them is set."""
    env = os.environ
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR) or None
    if num_processes is None and env.get(ENV_NUM_PROCESSES):
        num_processes = _int_env(ENV_NUM_PROCESSES)
    if process_id is None and env.get(ENV_PROCESS_ID):
        process_id = _int_env(ENV_PROCESS_ID)
    if local_device_ids is None:
        local_device_ids = env.get(ENV_LOCAL_DEVICE_IDS) or None
    if num_processes is None and env.get("SLURM_NTASKS") and int(env["SLURM_NTASKS"]) > 1:
        num_processes, process_id = int(env["SLURM_NTASKS"]), int(env.get("SLURM_PROCID", 0))
    num_processes = 1 if num_processes is None else num_processes
    process_id = 0 if process_id is None else process_id
    if num_processes < 1:
        raise DistributedError(f"--num_processes={num_processes}: need at least 1")
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"--process_id={process_id} is not in [0, {num_processes}) "
                               f"(--num_processes={num_processes})")
    if num_processes > 1 and not coordinator_address and "SLURM_NTASKS" not in env:
        raise DistributedError(f"--num_processes={num_processes} needs --coordinator_address=HOST:PORT (or "
                               f"{ENV_COORDINATOR}): the address of process 0, reachable from every process")
    ids = None
    if local_device_ids:
        try:
            ids = tuple(int(i) for i in str(local_device_ids).split(","))
        except ValueError:
            raise DistributedError(f"--local_device_ids={local_device_ids!r}: give comma-separated ints, "
                                   "e.g. 0,1") from None
    return ProcessSpec(coordinator_address, num_processes, process_id, ids)


def _int_env(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise DistributedError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


def initialize(spec: ProcessSpec, *, heartbeat_timeout_s: int = 60, init_timeout_s: int = 300) -> None:
    """Joins this process to the others of `spec` (a no-op for one process).

    Call it before anything touches a JAX backend. On CPU the cross-process collectives go through
    gloo. `heartbeat_timeout_s` bounds how long the survivors wait on a process that died: JAX's
    coordination service stops them with an error once its heartbeats are missing that long.
    """
    if not spec.multi:
        return
    if jax.distributed.is_initialized():
        return
    # Cross-process collectives of the CPU backend (the whole run on CPU; host-side programs on GPU).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(coordinator_address=spec.coordinator_address, num_processes=spec.num_processes,
                  process_id=spec.process_id, initialization_timeout=init_timeout_s,
                  heartbeat_timeout_seconds=heartbeat_timeout_s)
    if spec.local_device_ids is not None:
        kwargs["local_device_ids"] = list(spec.local_device_ids)
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # the coordinator is unreachable, or the processes disagree on the count
        raise DistributedError(f"process {spec.process_id} of {spec.num_processes} could not join the run at "
                               f"{spec.coordinator_address}: {type(e).__name__}: {str(e).splitlines()[0]}. "
                               "Check that process 0 runs and that the address is reachable") from None
    log.info("process %d of %d joined (%d local / %d global devices)", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


_barriers = 0
_group: tuple[int, ...] | None = None  # this process's side of an async run (`set_group`); None: every process


def set_group(processes) -> None:
    """Scopes the helpers below to `processes` (global process indices, this one among them); None: all."""
    global _group
    if processes is not None and jax.process_index() not in processes:
        raise DistributedError(f"set_group({list(processes)}): this process ({jax.process_index()}) is not in it")
    _group = None if processes is None else tuple(sorted(processes))


def group() -> tuple[int, ...]:
    """The global indices of the processes these helpers span (every process, unless `set_group` said)."""
    return _group if _group is not None else tuple(range(jax.process_count() if jax.distributed.is_initialized()
                                                         else 1))


def process_count() -> int:
    """Processes in the run (in this side's group); 1 without touching a backend when `jax.distributed` was not
    initialised (a driver process that holds no devices must not grab them)."""
    if _group is not None:
        return len(_group)
    return jax.process_count() if jax.distributed.is_initialized() else 1


def process_index() -> int:
    """This process's index in the run (in its side's group)."""
    if not jax.distributed.is_initialized():
        return 0
    return _group.index(jax.process_index()) if _group is not None else jax.process_index()


def is_main() -> bool:
    """Whether this process logs, prints and writes the run's own files (process 0)."""
    return process_index() == 0


def put(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array, equal on every process, as a global array with `sharding`.

    Each process copies only the slices its own devices hold; unlike `jax.device_put` on a sharding
    that spans processes, nothing checks (with a collective) that the processes agree.
    """
    x = np.asarray(x)
    if process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index], dtype=x.dtype)


def fetch(x) -> np.ndarray:
    """The global value of a device array, on every process."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def fetch_tree(tree):
    """`fetch` over a pytree (one host transfer for the fully addressable leaves)."""
    leaves, treedef = jax.tree.flatten(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.tree.unflatten(treedef, [np.asarray(x) for x in jax.device_get(leaves)])
    return jax.tree.unflatten(treedef, [fetch(x) for x in leaves])


def allgather_host(x: np.ndarray) -> np.ndarray:
    """[P, ...]: this process's host array stacked with every other process's (same shape on all)."""
    x = np.asarray(x)
    if process_count() == 1:
        return x[None]
    if _group is not None:
        return _group_allgather(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def _group_allgather(x: np.ndarray) -> np.ndarray:
    """`allgather_host` over the group's processes alone: an all-gather over one device of each."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    first = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)
    mesh = Mesh(np.asarray([first[p] for p in _group]), ("processes",))
    mine = jax.device_put(x[None], first[jax.process_index()])
    stacked = jax.make_array_from_single_device_arrays((len(_group), *x.shape),
                                                       NamedSharding(mesh, PartitionSpec("processes")), [mine])
    out = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))(stacked)
    return np.asarray(out.addressable_data(0))


def allgather_objects(obj) -> list:
    """[obj of process 0, obj of process 1, ...] on every process (picklable host objects)."""
    if process_count() == 1:
        return [obj]
    import pickle

    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = allgather_host(np.asarray([data.size], np.int64))[:, 0]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    gathered = allgather_host(padded)
    return [pickle.loads(gathered[i, : sizes[i]].tobytes()) for i in range(len(sizes))]


def broadcast_object(obj):
    """Process 0's `obj` on every process (the others pass anything, e.g. None)."""
    if process_count() == 1:
        return obj
    return allgather_objects(obj if is_main() else None)[0]


def share(n: int) -> slice:
    """This process's contiguous share of `n` items (the first processes take one more when uneven)."""
    p, i = process_count(), process_index()
    bounds = np.linspace(0, n, p + 1).astype(int)
    return slice(int(bounds[i]), int(bounds[i + 1]))


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (a no-op for one process)."""
    if process_count() > 1:
        if _group is not None:
            global _barriers
            _barriers += 1  # a barrier id is used once
            kv_client().wait_at_barrier(f"jaxrl_llm/{name}/{_barriers}", 600_000, process_ids=list(_group))
            return
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def kv_client():
    """The coordination service's client (its key-value store carries small host messages between processes:
    the async trainer's commands and finished samples, never weights)."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise DistributedError("the key-value store needs jax.distributed to be initialised (several processes)")
    return client


class HostShards:
    """This process's shards of one global array, held as host numpy arrays (host offload that works
    when the array spans several processes). Deliberately not a pytree: `jax.tree` functions see one
    leaf, so a tree of them maps back to device arrays with one `jax.tree.map(from_host_shards, ...)`."""

    def __init__(self, x: jax.Array):
        self.shape = x.shape
        self.sharding = x.sharding
        self.shards = [(s.device, np.asarray(s.data)) for s in x.addressable_shards]  # [(device, np.ndarray)]


def to_host_shards(x: jax.Array) -> HostShards:
    """`x` moved to host memory, to rebuild later with `from_host_shards`."""
    return HostShards(x)


def from_host_shards(saved: HostShards) -> jax.Array:
    """The global device array that `to_host_shards` saved, with its original sharding."""
    arrays = [jax.device_put(data, device) for device, data in saved.shards]
    return jax.make_array_from_single_device_arrays(saved.shape, saved.sharding, arrays)
