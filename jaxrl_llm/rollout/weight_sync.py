"""Weight sync from the training mesh to the rollout mesh (asynchronous training, issue 30): device to device, in
layer buckets, never through host memory.

In one_step_off and fully_async runs the trainer's params live on one set of devices and the rollout engine on
another. `WeightSync` moves a params tree across and returns it on the engine's devices, in a layout that
`EngineWeights.update_weights` converts there (casts, fuses, all-gathers) without another copy:

    sync = WeightSync.for_engine(engine)
    engine.update_weights(sync.from_model_state(worker.actor), step=version)

Per leaf (rollout/sync_layout.py says how the layouts are chosen):

* **Direct**: already in the engine dtype, and the rollout device count holds the source's tiling (1+1, 2+2,
  2+4, tensor-parallel on both sides...): each shard is copied as it is to its mirror on the rollout devices.
  Nothing is allocated on the training devices.
* **Through a bucket program**: fp32 master weights (cast to the engine dtype first, which halves the bytes
  copied) or a tiling the rollout devices cannot hold (3+1, 4+3, fsdp x tensor into tensor alone: the
  training devices all-gather the axes that do not fit). A program on the training devices slices a bucket
  of layers (about `bucket_bytes` of the model), casts and gathers it; its shards are copied; a donated
  program on the rollout devices writes them into the stacked arrays in place. At most `in_flight` buckets
  are out at once, so the trainer's extra memory is a bucket or two, not a second model.

LoRA syncs the adapters alone: `base_once(frozen)` moves the frozen base (bf16, or the 8-bit kernels and
fp32 scales of `model.base_quantization`, which stay 8-bit) once; each `adapters(trained, lora_scale=...)`
moves only the adapters (lora_b pre-scaled by alpha / r on the training devices, as
`ModelState.engine_params` does) and returns them joined with the kept base. The engine dequantizes and
merges layer by layer (`EngineWeights._to_engine`, `quant.plain_layer`).

Inside a sync, `no_host_copies()` makes any host round trip an error (`guard=True`), so a layout that JAX would
move through the host fails loudly instead of taking 30x longer.

*Across processes* (an async run whose rollout side is a process of its own, trainer/processes/placement.py) each side
makes a WeightSync with its `side`: 'send' on the training processes, 'receive' on the rollout's. Both run the same
sync, step for step: the programs on the training devices run where those devices are (the receiver passes over them
with the outputs' shapes), the programs on the rollout devices likewise, and each bucket's copies are one program over
both sides' devices (rollout/union_copy.py: XLA collective-permutes, NCCL on GPUs). The receiver holds ghosts of the
trainer's tree (`jax.ShapeDtypeStruct`s with the training shardings), sent as metadata (`plan_of` / `portable`: shapes,
dtypes, device ids, specs); nothing else crosses but the shards.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.models import quant
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.hf_table import set_path
from jaxrl_llm.models.lora import LORA_LEAVES, combine
from jaxrl_llm.rollout.sync_layout import CopyPlan, Route, SyncError, make_route, source_of
from jaxrl_llm.rollout.union_copy import UnionCopy

__all__ = ["SIDES", "SyncError", "SyncStats", "WeightSync", "from_portable", "ghosts", "no_host_copies", "portable"]

SIDES = (None, "send", "receive")


def _ghost(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def ghosts(tree):
    """`tree`'s leaves as ShapeDtypeStructs with their shardings: what a receiving side mirrors a sync from
    (picklable; the meshes name devices of every process)."""
    return jax.tree.map(lambda x: _ghost(x.shape, x.dtype, x.sharding), tree)


@dataclasses.dataclass(frozen=True)
class _Portable:
    """A ghost as plain values (devices by id), for a message to another process (devices do not pickle)."""

    shape: tuple
    dtype: str  # by name: numpy spells bfloat16 '|V2'
    devices: np.ndarray  # [mesh shape] device ids
    axes: tuple
    axis_types: tuple
    spec: PartitionSpec

    def ghost(self, by_id: dict) -> jax.ShapeDtypeStruct:
        mesh = Mesh(np.vectorize(by_id.__getitem__, otypes=[object])(self.devices), self.axes,
                    axis_types=self.axis_types)
        return _ghost(self.shape, jnp.dtype(self.dtype), NamedSharding(mesh, self.spec))


def portable(tree):
    """`ghosts(tree)` as picklable values; `from_portable` turns them back into ghosts in another process."""
    def one(x):
        mesh, spec = source_of(x, "portable")
        return _Portable(tuple(x.shape), jnp.dtype(x.dtype).name, np.vectorize(lambda d: d.id)(mesh.devices),
                         tuple(mesh.axis_names), tuple(mesh.axis_types), spec)
    return jax.tree.map(one, tree)


def from_portable(tree):
    by_id = {d.id: d for d in jax.devices()}
    return jax.tree.map(lambda p: p.ghost(by_id), tree, is_leaf=lambda x: isinstance(x, _Portable))


def _arrays(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]

KEEP_DTYPE = (quant.SCALE, *LORA_LEAVES)  # leaves the engine's merge reads in their own (fp32) precision


@contextlib.contextmanager
def no_host_copies():
    """Inside, any transfer between host and device raises, explicit ones too. JAX's fallback for a reshard it
    cannot do device to device fetches the array to the host and uploads it again; on GPUs both halves trip,
    on the CPU backend the upload does."""
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
            jax.transfer_guard_device_to_host("disallow_explicit"):
        yield


@dataclasses.dataclass
class SyncStats:
    """What the last sync did. bytes: copied device to device (all shards); copies: shard copies; buckets:
    bucket programs run on the training devices; bucket_bytes: the largest bucket's output on one training
    device (the sync's transient there); rounds: the most copy rounds of one batch (more than 1 where rollout
    devices pass on what they received: more replicas than holders); seconds: wall time until every copy
    landed; sent: bytes copied out of each device (by id), training and rollout."""

    seconds: float = 0.0
    bytes: int = 0
    copies: int = 0
    buckets: int = 0
    bucket_bytes: int = 0
    rounds: int = 0
    sent: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    path: tuple[str, ...]
    x: jax.Array
    route: Route
    spec: PartitionSpec
    dtype: np.dtype  # what it arrives in
    stack: str | None  # the layer stack its dim 0 runs over, or None

    @property
    def direct(self) -> bool:
        return self.dtype == self.x.dtype and not self.route.needs_gather(self.spec)

    def target(self) -> NamedSharding:
        return NamedSharding(self.route.target, self.spec)

    def gathered(self) -> NamedSharding:
        return NamedSharding(self.route.gathered, self.spec)


class WeightSync:
    """Moves params trees from training devices to an engine's devices, device to device.

    Args:
      cfg: the model config (its layer stacks say which leaves are stacked over layers).
      engine_mesh: the rollout engine's mesh (None: the first device, as the engines take it).
      dtype: the engine's dtype; wider float leaves are cast to it on the training devices (not the adapters or
        the 8-bit base's scales, which the engine's merge reads in fp32).
      bucket_bytes: the model bytes (in the engine dtype) a bucket program handles at most (at least a layer).
      in_flight: buckets dispatched before the sync waits for the oldest one's copies.
      guard: run every sync under `no_host_copies()`.
      side: None (both meshes in this process), 'send' (this process holds training devices, the engine's are
        another's) or 'receive' (this process holds the engine's devices; its calls take ghosts).
    """

    def __init__(self, cfg: DecoderConfig, engine_mesh: Mesh | None, *, dtype="bfloat16", bucket_bytes: int = 1 << 30,
                 in_flight: int = 2, guard: bool = True, side: str | None = None):
        if bucket_bytes < 1 or in_flight < 1:
            raise SyncError(f"WeightSync: bucket_bytes={bucket_bytes}, in_flight={in_flight}; both must be >= 1")
        if side not in SIDES:
            raise SyncError(f"WeightSync: side={side!r}; use one of {SIDES}")
        self.side = side
        self._union = UnionCopy() if side is not None else None
        self.layers = {name: len(ids) for name, ids in cfg.layer_stacks.items()}
        self.devices = list(engine_mesh.devices.flat) if engine_mesh is not None else [jax.devices()[0]]
        self.dtype = jnp.dtype(dtype)
        self.bucket_bytes, self.in_flight, self.guard = bucket_bytes, in_flight, guard
        self.stats = SyncStats()
        self.base_stats: SyncStats | None = None
        self._routes: dict[Mesh, Route] = {}
        self._programs: dict = {}
        self._base: dict | None = None

    @classmethod
    def for_engine(cls, engine, **kw) -> WeightSync:
        """A sync into `engine` (a JaxEngine or DenseJaxEngine): its config, mesh and dtype."""
        return cls(engine.cfg, engine.mesh, dtype=engine.cfg.dtype, **kw)

    # ---- the public calls -------------------------------------------------------------------------
    def __call__(self, params: dict) -> dict:
        """`params` (any tree of the trainer's arrays) on the engine's devices, cast to the engine dtype."""
        with self._guard():
            return self._timed(params)

    def base_once(self, frozen: dict) -> None:
        """Moves LoRA's frozen base (bf16, or 8-bit kernels with fp32 scales) and keeps it on the engine's devices."""
        self._base = None
        with self._guard():
            self._base = self._timed(frozen)
        self.base_stats = self.stats

    def drop_base(self) -> None:
        """Lets go of the kept base (its memory on the engine's devices); the next LoRA sync moves it again."""
        self._base = None

    def adapters(self, trained: dict, *, lora_scale: float) -> dict:
        """The kept base joined with `trained` (the adapters, lora_b pre-scaled here by `lora_scale` = alpha / r)
        on the engine's devices: what `engine.update_weights` takes. Only the adapters' bytes move."""
        if self._base is None:
            raise SyncError("WeightSync.adapters: no base on the rollout devices yet; call base_once(actor.frozen) "
                            "first (once a run: the frozen base never changes)")
        t0 = time.perf_counter()
        with self._guard():
            out = self._timed(self._prescale(trained, float(lora_scale)))
        self.stats.seconds = time.perf_counter() - t0  # the pre-scaling program included
        return combine(self._base, out)

    def from_model_state(self, actor) -> dict:
        """What `engine.update_weights` takes for a `ModelState` (trainer/roles/model_state.py): full fine-tuning, its
        params (fp32 masters, cast in buckets on the training devices); LoRA, its adapters joined with the
        frozen base, which moves at the first call only."""
        if actor.lora is None:
            return self(actor.state["params"])
        if self._base is None:
            self.base_once(actor.frozen)
        return self.adapters(actor.state["params"], lora_scale=actor.lora.scale)

    def plan_of(self, actor) -> dict:
        """What a receiving side needs to mirror the next `from_model_state(actor)`: ghosts of the trees it moves
        (LoRA's frozen base only at the first sync) and LoRA's scale. Call it before that sync."""
        if actor.lora is None:
            return {"params": portable(actor.state["params"])}
        return {"frozen": portable(actor.frozen) if self._base is None else None,
                "trained": portable(actor.state["params"]), "lora_scale": actor.lora.scale}

    def from_plan(self, plan: dict) -> dict:
        """The receiving side's half of `from_model_state` (`side='receive'`): the same sync, from ghosts; returns
        the arrays on the engine's devices."""
        if "params" in plan:
            return self(from_portable(plan["params"]))
        if plan["frozen"] is not None:
            self.base_once(from_portable(plan["frozen"]))
        return self.adapters(from_portable(plan["trained"]), lora_scale=plan["lora_scale"])

    def describe(self, params: dict) -> list[str]:
        """One line per source mesh in `params`: what the sync does for it."""
        return sorted({leaf.route.describe() for leaf in self._leaves(params)})

    # ---- the sync ---------------------------------------------------------------------------------
    def _guard(self):
        return no_host_copies() if self.guard else contextlib.nullcontext()

    def _timed(self, tree: dict) -> dict:
        t0 = time.perf_counter()
        self.stats = SyncStats()
        out = self._send(tree)
        jax.block_until_ready(_arrays(out))
        self.stats.seconds = time.perf_counter() - t0
        return out

    def _send(self, tree: dict) -> dict:
        leaves = self._leaves(tree)
        load: dict = {}  # bytes out of each training device, to spread copies of replicated shards
        done: dict[tuple, jax.Array] = {}
        direct = [leaf for leaf in leaves if leaf.direct]
        if direct:
            done.update(zip([leaf.path for leaf in direct], self._copy(direct, [leaf.x for leaf in direct], load)))
        rest = [leaf for leaf in leaves if not leaf.direct]
        stacked = [leaf for leaf in rest if leaf.stack is not None]
        staging = dict(zip([leaf.path for leaf in stacked], self._zeros(stacked))) if stacked else {}
        pending: collections.deque = collections.deque()
        for bucket, rows in self._buckets(rest):
            parts = self._copy(bucket, self._bucket_program(bucket, rows)(*[leaf.x for leaf in bucket]), load)
            if rows is None:
                done.update(zip([leaf.path for leaf in bucket], parts))
            else:
                paths = [leaf.path for leaf in bucket]
                new = self._update_program(bucket, rows)([staging.pop(p) for p in paths], parts)
                staging.update(zip(paths, new))
            pending.append(parts)
            if len(pending) >= self.in_flight:  # the oldest bucket's copies land before another program runs
                jax.block_until_ready(_arrays(pending.popleft()))
        done.update(staging)
        self.stats.sent = {getattr(d, "id", d): n for d, n in load.items()}
        out: dict = {}
        for leaf in leaves:
            set_path(out, leaf.path, done[leaf.path])
        return out

    def _leaves(self, tree: dict) -> list[_Leaf]:
        if not isinstance(tree, dict) or not tree:
            raise SyncError(f"WeightSync: expected a non-empty params tree (nested dicts of arrays), got "
                            f"{type(tree).__name__}")
        out = []
        for keys, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            path = tuple(str(getattr(k, "key", k)) for k in keys)
            where = "/".join(path)
            ghost = self.side == "receive" and isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
            if not isinstance(x, jax.Array) and not ghost:
                raise SyncError(f"WeightSync: {where} is a {type(x).__name__}, not a jax.Array on the training "
                                "devices; pass the trainer's device arrays (never host copies)")
            mesh, spec = source_of(x, where)
            if mesh not in self._routes:
                self._routes[mesh] = make_route(mesh, self.devices, local=self.side is None)
            cast = (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > self.dtype.itemsize
                    and path[-1] not in KEEP_DTYPE)
            stack = path[1] if len(path) > 2 and path[0] == "model" and path[1] in self.layers else None
            if stack is not None and (x.ndim == 0 or x.shape[0] != self.layers[stack]
                                     or (len(spec) and spec[0] is not None)):
                stack = None  # not stacked over the layers as the config says, or split over them: moved whole
            out.append(_Leaf(path, x, self._routes[mesh], spec, self.dtype if cast else x.dtype, stack))
        return out

    def _copy(self, leaves: list[_Leaf], arrays: list[jax.Array], load: dict) -> list[jax.Array]:
        if self._union is not None:  # across processes: one program over both sides' devices
            before = (self._union.bytes, self._union.count)
            out = self._union.run(arrays, [leaf.target() for leaf in leaves], load)
            self.stats.bytes += self._union.bytes - before[0]
            self.stats.copies += self._union.count - before[1]
            return out
        plan = CopyPlan(load)
        for leaf, x in zip(leaves, arrays):
            plan.add(x, leaf.target(), "/".join(leaf.path))
        self.stats.bytes += plan.bytes
        self.stats.copies += plan.count
        self.stats.rounds = max(self.stats.rounds, plan.rounds)
        return plan.run()

    def _buckets(self, leaves: list[_Leaf]):
        """(leaves, (first layer, end layer) or None for whole leaves) of every bucket program, per source mesh."""
        by_route: dict = {}
        for leaf in leaves:
            by_route.setdefault((leaf.route, leaf.stack), []).append(leaf)
        for (_, stack), group in by_route.items():
            if stack is None:
                bucket, size = [], 0
                for leaf in group:  # whole leaves, packed up to bucket_bytes
                    nbytes = leaf.x.size * leaf.dtype.itemsize
                    if bucket and size + nbytes > self.bucket_bytes:
                        yield bucket, None
                        bucket, size = [], 0
                    bucket.append(leaf)
                    size += nbytes
                yield bucket, None
            else:
                n = self.layers[stack]
                per_layer = sum(leaf.x.size // n * leaf.dtype.itemsize for leaf in group)
                step = max(1, min(n, self.bucket_bytes // max(per_layer, 1)))
                for start in range(0, n, step):
                    yield group, (start, min(n, start + step))

    def _bucket_program(self, bucket: list[_Leaf], rows):
        """The training devices' program of a bucket: slice its layers, cast, all-gather to the route's layout."""
        key = ("bucket", rows, tuple((leaf.path, leaf.x.shape, leaf.x.dtype, leaf.x.sharding, leaf.dtype)
                                     for leaf in bucket))
        if key not in self._programs:
            dtypes = [leaf.dtype for leaf in bucket]

            def program(*xs):
                return [(x if rows is None else x[rows[0]:rows[1]]).astype(dt) for x, dt in zip(xs, dtypes)]

            self._programs[key] = jax.jit(program, out_shardings=[leaf.gathered() for leaf in bucket])
            if self.side == "receive":  # the training devices run it; here, its outputs' shapes
                self._programs[key] = lambda *xs: [
                    _ghost(x.shape if rows is None else (rows[1] - rows[0],) + x.shape[1:], leaf.dtype, leaf.gathered())
                    for x, leaf in zip(xs, bucket)]
        self.stats.buckets += 1
        per_device = 0
        for leaf in bucket:
            shape = leaf.x.shape if rows is None else (rows[1] - rows[0],) + leaf.x.shape[1:]
            per_device += int(np.prod(leaf.gathered().shard_shape(shape))) * leaf.dtype.itemsize
        self.stats.bucket_bytes = max(self.stats.bucket_bytes, per_device)
        return self._programs[key]

    def _zeros(self, leaves: list[_Leaf]) -> list[jax.Array]:
        """The stacked arrays a sync's buckets are written into, allocated on the rollout devices."""
        key = ("zeros", tuple((leaf.x.shape, leaf.dtype, leaf.target()) for leaf in leaves))
        if key not in self._programs:
            specs = [(leaf.x.shape, leaf.dtype) for leaf in leaves]
            self._programs[key] = jax.jit(lambda: [jnp.zeros(s, d) for s, d in specs],
                                          out_shardings=[leaf.target() for leaf in leaves])
            if self.side == "send":  # the rollout devices run it
                self._programs[key] = lambda: [_ghost(leaf.x.shape, leaf.dtype, leaf.target()) for leaf in leaves]
        return self._programs[key]()

    def _update_program(self, bucket: list[_Leaf], rows):
        """The rollout devices' program of a bucket: its layers written into the stacked arrays, donated (in place)."""
        key = ("update", rows, tuple((leaf.x.shape, leaf.dtype, leaf.target()) for leaf in bucket))
        if key not in self._programs:
            def update(fulls, parts):
                return [jax.lax.dynamic_update_slice_in_dim(f, p, rows[0], axis=0) for f, p in zip(fulls, parts)]

            self._programs[key] = jax.jit(update, donate_argnums=0, out_shardings=[leaf.target() for leaf in bucket])
            if self.side == "send":  # the rollout devices run it
                self._programs[key] = lambda fulls, parts: fulls
        return self._programs[key]

    def _prescale(self, trained: dict, scale: float) -> dict:
        """`trained` with every lora_b times `scale` in its own dtype, on the training devices (as
        `ModelState.engine_params`, so the engine's merge adds lora_a @ lora_b unscaled)."""
        if self.side == "receive":  # the training devices pre-scale; the shapes stay
            return trained
        leaves, treedef = jax.tree_util.tree_flatten_with_path(trained)
        key = ("prescale", scale, treedef, tuple((x.shape, x.dtype, x.sharding) for _, x in leaves))
        if key not in self._programs:
            def prescale(tree):
                return jax.tree_util.tree_map_with_path(
                    lambda p, x: x * jnp.asarray(scale, x.dtype) if str(getattr(p[-1], "key", "")) == "lora_b" else x,
                    tree)

            self._programs[key] = jax.jit(prescale, out_shardings=jax.tree.map(lambda x: x.sharding, trained))
        return self._programs[key](trained)
