"""Shard copies from training devices to rollout devices of other processes: one program over both sides' devices.

`jax.device_put` cannot do it on every stack: between processes it needs a backend with cross-host transfers
(jax 0.10.2's CPU backend has none and asks for a socket address instead, a host path), and JAX falls back to no
collective. A program over a mesh of both sides' devices can: each copy is a `ppermute` (XLA's collective-permute:
NCCL send/recv on GPUs, gloo on CPU), device memory to device memory, and both sides run the same program, the
training processes with their shards as the input, the rollout processes with empty buffers of the same shape.

The plan (who sends which shard where) is a function of the shardings alone, so every process computes the same
one without seeing the others' arrays: the rollout processes hold `jax.ShapeDtypeStruct`s of the training leaves
(ghosts, with their shardings on the training mesh) and get real arrays back; the training processes hold the
arrays and get ghosts back. A rollout shard comes from the least loaded training device that holds its index, as
in `CopyPlan` (rollout/sync_layout.py); a device that sends several shards does so over several rounds of one
program (a ppermute is a permutation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl_llm.rollout.sync_layout import SyncError

AXIS = "sync_union"


def _key(index: tuple, shape: tuple) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _order(devices) -> list:
    return sorted(devices, key=lambda d: (d.process_index, d.id))


@dataclasses.dataclass(frozen=True)
class _Item:
    shape: tuple
    dtype: np.dtype
    shard: tuple  # every device's shard shape (the same on both sides: the route keeps the tiling)
    rounds: tuple  # per round, ((source position, target position), ...) in the union mesh


class UnionCopy:
    """Batched copies of many leaves' shards over one union mesh; `run` on every process of both sides."""

    def __init__(self):
        self._programs: dict = {}
        self._zeros: dict = {}
        self.bytes = self.count = 0

    def run(self, arrays: list, targets: list[NamedSharding], load: dict) -> list:
        """`arrays` (the sender's jax.Arrays, or ghosts elsewhere) on `targets`: real arrays on the processes that
        hold target devices, ghosts on the others. `load`: bytes sent out of each device so far (shared over
        the calls of a sync, so copies of replicated shards spread)."""
        if not arrays:
            return []
        devices = _order({d for x, t in zip(arrays, targets) for d in (*x.sharding.device_set, *t.device_set)})
        pos = {d: i for i, d in enumerate(devices)}
        mesh = Mesh(np.asarray(devices, dtype=object), (AXIS,))
        items = [self._plan(x, t, pos, load) for x, t in zip(arrays, targets)]
        me = jax.process_index()
        local = [d for d in devices if d.process_index == me]
        spec = NamedSharding(mesh, PartitionSpec(AXIS))
        blocks = []
        for x, item in zip(arrays, items):
            held = {s.device: s.data for s in x.addressable_shards} if isinstance(x, jax.Array) else {}
            mine = [self._block(held[d]) if d in held else self._empty(item, d) for d in local]
            gshape = (len(devices) * _flat(item.shard)[0], *_flat(item.shard)[1:])
            blocks.append(jax.make_array_from_single_device_arrays(gshape, spec, mine))
        out = self._program(mesh, items)(*blocks)
        results = []
        for o, t, item in zip(out, targets, items):
            if any(d.process_index == me for d in t.device_set):
                got = {s.device: s.data for s in o.addressable_shards}
                shards = [got[d] if got[d].shape == item.shard else got[d].reshape(item.shard)
                          for d in t.addressable_devices]
                results.append(jax.make_array_from_single_device_arrays(item.shape, t, shards))
            else:
                jax.block_until_ready(o)  # the sender's transient (its empty outputs) goes before the next bucket
                results.append(jax.ShapeDtypeStruct(item.shape, item.dtype, sharding=t))
        return results

    def _plan(self, x, target: NamedSharding, pos: dict, load: dict) -> _Item:
        shape, src = tuple(x.shape), x.sharding
        shard = tuple(src.shard_shape(shape))
        if tuple(target.shard_shape(shape)) != shard:
            raise SyncError(f"union copy: source shards {shard} and target shards {target.shard_shape(shape)} differ "
                            "(the route keeps the source's tiling); this is a bug in the route")
        holders: dict[tuple, list] = {}
        for d, index in src.devices_indices_map(shape).items():
            holders.setdefault(_key(index, shape), []).append(d)
        nbytes = int(np.prod(shard)) * jnp.dtype(x.dtype).itemsize
        rounds: list[list] = []
        for d, index in sorted(target.devices_indices_map(shape).items(), key=lambda kv: pos[kv[0]]):
            candidates = holders.get(_key(index, shape))
            if not candidates:
                raise SyncError(f"union copy: no training device holds the shard {index} that rollout device {d} "
                                f"needs (source {src}, target {target}); this is a bug in the route")
            h = min(_order(candidates), key=lambda c: load.get(c.id, 0))
            load[h.id] = load.get(h.id, 0) + nbytes
            self.bytes += nbytes
            self.count += 1
            r = next((i for i, pairs in enumerate(rounds) if all(p[0] != pos[h] for p in pairs)), len(rounds))
            if r == len(rounds):
                rounds.append([])
            rounds[r].append((pos[h], pos[d]))
        return _Item(shape, jnp.dtype(x.dtype), shard, tuple(tuple(p) for p in rounds))

    @staticmethod
    def _block(data: jax.Array) -> jax.Array:
        return data if data.ndim else data.reshape(1)

    def _empty(self, item: _Item, device) -> jax.Array:
        """An empty block on a device that receives (or holds nothing of this leaf)."""
        key = (_flat(item.shard), item.dtype, device)
        if key not in self._zeros:
            shape, dtype = _flat(item.shard), item.dtype
            self._zeros[key] = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=SingleDeviceSharding(device))
        return self._zeros[key]()

    def _program(self, mesh: Mesh, items: list[_Item]):
        key = (mesh, tuple((_flat(i.shard), i.dtype, i.rounds) for i in items))
        if key not in self._programs:
            n = mesh.size

            def copy(*blocks):
                me = jax.lax.axis_index(AXIS)
                out = []
                for b, item in zip(blocks, items):
                    acc = jnp.zeros_like(b)
                    for pairs in item.rounds:
                        got = np.zeros(n, bool)
                        got[[t for _, t in pairs]] = True
                        acc = jnp.where(jnp.asarray(got)[me], jax.lax.ppermute(b, AXIS, list(pairs)), acc)
                    out.append(acc)
                return out

            spec = PartitionSpec(AXIS)
            self._programs[key] = jax.jit(jax.shard_map(copy, mesh=mesh, in_specs=(spec,) * len(items),
                                                        out_specs=[spec] * len(items)))
        return self._programs[key]


def _flat(shard: tuple) -> tuple:
    return shard if shard else (1,)
