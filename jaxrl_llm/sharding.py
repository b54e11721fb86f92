"""Device meshes and the logical-axis rules: the only module that names mesh axes.

Parameters and activations carry *logical* axis names ("embed", "mlp", "batch", ...). `RULES` maps
each to a mesh axis of the ("data", "fsdp", "expert", "tensor") mesh. A dimension that the mesh axis
does not divide stays replicated, so every rule works on any device count, 1 included.

The "expert" axis splits a MoE's experts (expert parallelism); outside the expert layers its devices
are data-parallel (the batch is split over it too), so a dense model on such a mesh is unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axis -> mesh axis (or a tuple of mesh axes, or None for replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp", "expert"),
    "length": None,
    "act_embed": None,
    "act_mlp": "tensor",
    "act_heads": "tensor",
    "act_vocab": "tensor",
    # parameters
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",  # a MoE's experts ([L, E, D, I] weights)
    "norm": None,
    "value": None,
    # sampler KV caches [B, K, S, H]
    "act_kv_heads": "tensor",
}

# The sampler's parameter layout: decode reads every weight once per token, so all-gathering
# fsdp shards each step would dominate. Weights are replicated over data/fsdp/expert and split only over
# "tensor"; the batch is split over data x fsdp x expert, so decode runs data-parallel without collectives.
ENGINE_RULES = {**RULES, "embed": None, "expert": None}


class MeshError(ValueError):
    """A mesh shape that the devices cannot form."""


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None, *, expert: int = 1) -> Mesh:
    """A ("data", "fsdp", "expert", "tensor") mesh; one size may be -1 to take the remaining devices.

    Not a gin configurable: runs set the mesh with `train.mesh_data/fsdp/tensor`, which the trainer
    passes explicitly (so a `make_mesh.*` binding was a silent no-op), and gin would append a second
    line to a MeshError's message.
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = [data, fsdp, expert, tensor]
    named = f"mesh (data={data}, fsdp={fsdp}, expert={expert}, tensor={tensor})"
    if sizes.count(-1) > 1:
        raise MeshError(f"{named}: at most one size may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or len(devices) % known:
        raise MeshError(
            f"{named} does not fit {len(devices)} device(s); the product of the sizes must divide the device "
            "count (gin: train.mesh_data, train.mesh_fsdp, train.mesh_expert, train.mesh_tensor; -1 takes the "
            "remaining devices)")
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devices):
        if jax.process_count() > 1:
            raise MeshError(
                f"{named} uses {math.prod(sizes)} of the {len(devices)} devices of this {jax.process_count()}-"
                "process run; a multi-process mesh must use every device (set one of train.mesh_data / "
                "mesh_fsdp / mesh_expert / mesh_tensor to -1)")
        devices = devices[: math.prod(sizes)]
    arr = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _mesh_size(mesh, axes) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, rules: dict | None = None) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    With `shape` and `mesh`, a dimension the mesh axes do not divide is left replicated, and a mesh
    axis is used at most once (the first dimension that asks for it wins).
    """
    rules = RULES if rules is None else rules
    used: set[str] = set()
    spec = []
    for i, name in enumerate(logical_axes):
        axes = rules.get(name) if name is not None else None
        if axes is not None:
            axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
            if mesh is not None:
                axes_t = tuple(a for a in axes_t if mesh.shape.get(a, 1) > 1)
            if any(a in used for a in axes_t):
                axes_t = ()
            if shape is not None and mesh is not None and axes_t and shape[i] % _mesh_size(mesh, axes_t):
                axes_t = ()
            used.update(axes_t)
            axes = None if not axes_t else (axes_t[0] if len(axes_t) == 1 else axes_t)
        spec.append(axes)
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, logical_axes: Sequence[str | None],
                   shape: Sequence[int] | None = None, rules: dict | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint at a block boundary, under the ambient mesh (`jax.set_mesh`); a no-op
    when no mesh is set, so model code runs unchanged on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return x
    spec = logical_to_spec(logical_axes, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, spec)


def batch_sharding(mesh: Mesh, ndim: int, shape: Sequence[int] | None = None) -> NamedSharding:
    """Leading dim over the data-parallel axes, the rest replicated."""
    return named_sharding(mesh, ("batch",) + (None,) * (ndim - 1), shape)


def expert_axis(mesh) -> str | None:
    """The mesh axis that splits a MoE's experts, or None when the mesh does not split them."""
    axis = RULES["expert"]
    return axis if not mesh.empty and mesh.shape.get(axis, 1) > 1 else None


def data_parallel_size(mesh: Mesh) -> int:
    return _mesh_size(mesh, RULES["batch"])
