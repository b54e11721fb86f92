"""Where each shard of a training-mesh array goes on the rollout devices, so that every copy is device to device.

`jax.device_put` between disjoint devices copies shard by shard only when every shard of the target layout
exists, whole and with the same index, in the source; otherwise it fetches the array to host memory and
uploads it again (0.75-1.0 s for 7B on H200s instead of 25-43 ms, and silently). The weight sync
(rollout/weight_sync.py) therefore picks, per source mesh, a *route*:

* **Kept pieces.** Each axis of the source mesh (size s) keeps k pieces, k a divisor of s, with the product of
  the kept pieces dividing the rollout device count n_r: from the minor axis (tensor) to the major one,
  k = gcd(s, what n_r has left). Keeping the minor axis first keeps the tensor split the engine wants.
* **Gathered source layout** (`gathered`): the source mesh's devices, each axis split into (kept, rest), the
  leaf's own PartitionSpec on it. Where an axis the leaf uses keeps fewer pieces than it has, a program on
  the training devices all-gathers that bucket into this layout first (a whole replica where nothing is kept).
* **Target layout** (`target`): the rollout devices in the engine mesh's order, as a replica axis of
  n_r / prod(k) and the kept axes, with the same PartitionSpec: the same tiling as the gathered layout, so
  each rollout device's shard exists on some training device. The engine's conversion takes it on its own
  devices (jit accepts inputs on any mesh of the engine's devices in the same order) and all-gathers there.

Each rollout shard is then one explicit device-to-device copy from a training device that holds it, spread
over the holders (`copy_plan`), so replicated sources do not all copy out of one device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

REPLICA = "sync_replica"  # the target mesh's leading axis: copies of the kept tiling over the rollout devices
REST = "_rest"  # suffix of the gathered mesh's axes that are gathered over


class SyncError(ValueError):
    """A params tree or a pair of meshes the weight sync cannot move device to device."""


@dataclasses.dataclass(frozen=True, eq=False)  # one per source mesh (WeightSync caches them): hashed by identity
class Route:
    """How the leaves of one source mesh reach the rollout devices.

    keep: {source mesh axis: pieces kept} (a divisor of the axis size; 1: gathered over).
    gathered: the source devices as (axis, axis_rest) pairs, kept pieces major: the layout a bucket takes on
      the training devices before its copies.
    target: the rollout devices (the engine mesh's order) as (sync_replica, *kept axes).
    """

    source: Mesh
    keep: dict
    gathered: Mesh
    target: Mesh

    def needs_gather(self, spec: PartitionSpec) -> bool:
        """Whether a leaf of this PartitionSpec must be all-gathered on the source before its copies."""
        return any(self.keep[a] < self.source.shape[a] for a in _spec_axes(spec))

    def describe(self) -> str:
        src = "x".join(f"{a}{n}" for a, n in self.source.shape.items() if n > 1) or "one device"
        kept = "x".join(f"{a}{n}" for a, n in self.keep.items() if n > 1) or "no split (whole replicas)"
        gathered = [f"{a} {self.source.shape[a]}->{n}" for a, n in self.keep.items() if n < self.source.shape[a]]
        how = (f"leaves split over {', '.join(gathered)} are gathered in buckets on the training devices; "
               if gathered else "")
        return (f"training {src} ({self.source.size}) -> rollout {self.target.size}: keep {kept}; {how}every shard "
                f"copied device to device, {self.target.shape[REPLICA]} copy(ies) of the kept tiling")


def source_of(x: jax.Array, where: str) -> tuple[Mesh, PartitionSpec]:
    """(mesh, PartitionSpec) of a source leaf; a single-device array is a mesh of one device, replicated."""
    sh = x.sharding
    if isinstance(sh, NamedSharding):
        return sh.mesh, sh.spec
    if isinstance(sh, SingleDeviceSharding):
        (dev,) = sh.device_set
        return Mesh(np.asarray([dev], dtype=object), ("single",), axis_types=(AxisType.Auto,)), PartitionSpec()
    raise SyncError(f"{where}: a leaf with {type(sh).__name__}; the weight sync moves arrays placed with a "
                    "NamedSharding (the trainer's `param_shardings`) or on one device")


def make_route(source: Mesh, rollout_devices: Sequence[jax.Device], *, local: bool = True) -> Route:
    """The route from `source`'s devices to `rollout_devices` (in the engine mesh's flat order); `local`: both in
    this process (else the copies are one program over both processes' devices, rollout/union_copy.py)."""
    if local:
        _check_local(list(source.devices.flat) + list(rollout_devices))
    n_r, left = len(rollout_devices), len(rollout_devices)
    keep = {}
    for axis in reversed(source.axis_names):  # minor axes (tensor) first: the engine keeps them split too
        keep[axis] = math.gcd(source.shape[axis], left)
        left //= keep[axis]
    keep = {a: keep[a] for a in source.axis_names}
    names, sizes = [], []
    for a in source.axis_names:
        names += [a, a + REST]
        sizes += [keep[a], source.shape[a] // keep[a]]
    auto = lambda n: (AxisType.Auto,) * n
    gathered = Mesh(source.devices.reshape(sizes), tuple(names), axis_types=auto(len(names)))
    kept = math.prod(keep.values())
    target = Mesh(np.asarray(rollout_devices, dtype=object).reshape([n_r // kept] + [keep[a] for a in keep]),
                  (REPLICA, *source.axis_names), axis_types=auto(len(keep) + 1))
    return Route(source, keep, gathered, target)


def _check_local(devices) -> None:
    me = jax.process_index()
    far = sorted({d.process_index for d in devices} - {me})
    if far:
        raise SyncError(f"this weight sync runs within one process; devices of process(es) {far} are not this "
                        f"process's ({me}). Across processes give WeightSync a side ('send' on the training "
                        "processes, 'receive' on the rollout's): the copies are then one program over both")


def _spec_axes(spec: PartitionSpec) -> list[str]:
    out = []
    for entry in spec:
        if entry is not None:
            out += [entry] if isinstance(entry, str) else list(entry)
    return out


def _device(x: jax.Array) -> jax.Device:
    return next(iter(x.devices()))


def _index_key(index: tuple, shape: tuple) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class CopyPlan:
    """Device-to-device copies of many arrays' shards, done as a few batched `jax.device_put`s (rounds).

    `add(x, target)` plans the copies that give `target` (a sharding on the rollout devices) the values of `x`;
    `run()` dispatches them and returns the new arrays in order. A rollout shard is copied from a device that
    holds its exact index: a training device, the least loaded one so far, or, where the rollout side wants
    more copies of an index than the training side holds (1+3: three replicas of one device), a rollout device
    that received it in an earlier round. Each holder sends an index once a round, so the holders double every
    round, and the copies out of a training device fall from one per replica to about log2 of them (1+3: two
    rounds, the training device sending twice, not three times). A missing index is a SyncError: the route
    promises there is none, and the alternative would be JAX's silent host round trip.
    """

    def __init__(self, load: dict | None = None):
        self.load = {} if load is None else load  # bytes copied out of each device so far
        self._items: list[tuple[tuple, NamedSharding, list[int]]] = []  # shape, target, its copies' slots
        self._copies: list[tuple[int, object, jax.Device]] = []  # (round, source buffer or earlier slot, device)
        self.bytes = 0
        self.count = 0
        self.rounds = 0

    def add(self, x: jax.Array, target: NamedSharding, where: str) -> None:
        held: dict[tuple, list] = {}
        for s in x.addressable_shards:
            held.setdefault(_index_key(s.index, x.shape), []).append(s.data)
        wanted: dict[tuple, list[jax.Device]] = {}
        for dev, index in target.addressable_devices_indices_map(x.shape).items():
            key = _index_key(index, x.shape)
            if not held.get(key):
                raise SyncError(f"{where}: no training device holds the shard {index} that rollout device {dev} needs "
                                f"(source {x.sharding}, target {target}); this is a bug in the route")
            wanted.setdefault(key, []).append(dev)
        slot_of: dict[jax.Device, int] = {}
        for key, devices in wanted.items():
            slot_of.update(self._schedule(held[key], devices))
        self._items.append((x.shape, target, [slot_of[d] for d in target.addressable_devices_indices_map(x.shape)]))

    def _schedule(self, sources: list[jax.Array], devices: list[jax.Device]) -> dict[jax.Device, int]:
        """Copies of one index to `devices`, in rounds; returns each device's slot in `self._copies`."""
        nbytes = sources[0].nbytes
        slots, todo = {}, []
        on_device = {_device(b): b for b in sources}
        for dev in devices:  # a device that holds the index already copies it locally, outside the rounds
            if dev in on_device:
                slots[dev] = self._put(0, on_device[dev], dev, nbytes, count_load=False)
            else:
                todo.append(dev)
        holders: list = list(sources)  # buffers, or slots of copies from earlier rounds
        rnd = 0
        while todo:
            senders = sorted(holders, key=lambda h: self.load.get(self._holder_device(h), 0))
            received = []
            for h, dev in zip(senders, list(todo)):
                slots[dev] = self._put(rnd, h, dev, nbytes)
                received.append(slots[dev])
                todo.remove(dev)
            holders += received
            rnd += 1
        return slots

    def _holder_device(self, h) -> jax.Device:
        return self._copies[h][2] if isinstance(h, int) else _device(h)

    def _put(self, rnd: int, src, dev: jax.Device, nbytes: int, *, count_load: bool = True) -> int:
        if count_load:
            d = self._holder_device(src)
            self.load[d] = self.load.get(d, 0) + nbytes
        self.bytes += nbytes
        self.count += 1
        self.rounds = max(self.rounds, rnd + 1)
        self._copies.append((rnd, src, dev))
        return len(self._copies) - 1

    def run(self) -> list[jax.Array]:
        if not self._copies:
            return []
        done: list = [None] * len(self._copies)
        for rnd in range(self.rounds):
            batch = [i for i, c in enumerate(self._copies) if c[0] == rnd]
            srcs = [done[src] if isinstance(src, int) else src for _, src, _ in (self._copies[i] for i in batch)]
            # may_alias=False: a shard already on its rollout device is still copied, so the result never shares
            # a buffer that the trainer may donate to its next update.
            outs = jax.device_put(srcs, [self._copies[i][2] for i in batch], may_alias=False)
            for i, y in zip(batch, outs):
                done[i] = y
        out = [jax.make_array_from_single_device_arrays(shape, target, [done[i] for i in slots])
               for shape, target, slots in self._items]
        self._copies, self._items = [], []
        return out
