"""The engine's compiled programs: built ahead in parallel threads, and kept on disk between processes.

The paged engine runs one decode program per slot bucket (about 17 up to 1,024 rows). Compiled one at a
time as the first rollout reaches each bucket, they cost its generation 137 s at 1.5B on an H100. With
jax's persistent cache warm, every program still has to be traced and lowered to find its cache key, then
loaded: about 1.3 s each, so 27 s against a 3.8 s steady rollout.

`Programs` does two things about it:

* **Ahead, in parallel.** `warm` builds a list of programs on a thread pool before the rollout needs them.
  Tracing and lowering hold the GIL; XLA's compile and an executable's load do not, so they overlap.
* **On disk, keyed without tracing.** Where jax's persistent cache is on (`train.compilation_cache_dir`;
  GPUs and TPUs),
  every compiled program is also written, serialized, under its `jaxrl_engine/` folder. The key is a hash
  of what decides the program: the program's name, its static arguments, every input's shape, dtype and
  sharding, the engine's fingerprint (model config and engine options), the source of this package and of
  `kernels/`, jax's version, the device kind, XLA_FLAGS and the process's place. A later process loads it
  without tracing or lowering, and loads all of an engine's programs in the background from the moment
  the engine is built. Any change to the code or config changes the key; a stale file is never read, and
  an unreadable one is rebuilt.

* **Once for every shard.** Each data-parallel shard of the engine runs the same programs on its own devices.
  A program is compiled (or loaded) once, for the first shard's devices; every other shard gets the same
  executable loaded onto its devices in milliseconds (`for_group`: the serialized executable, its devices
  mapped one to one), instead of a trace, a lowering and a compile (or a cache lookup) per shard. Not on the CPU
  backend, where a moved executable can miss its kernels at run time ("Function ... not found"): there each
  shard compiles its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import io
import logging
import os
import pickle
import threading
import time

import jax
import numpy as np

log = logging.getLogger(__name__)

SUBDIR = "jaxrl_engine"

# Every program this process holds, by key: engines of one config share them (a key names its config).
_HELD: dict[str, object] = {}
_BUILDING: dict[str, concurrent.futures.Future] = {}  # programs a thread is building now
_HELD_LOCK = threading.Lock()


def forget_held() -> None:
    """Drops this process's programs (as a new process starts without them); for tests."""
    with _HELD_LOCK:
        _HELD.clear()


@functools.cache
def source_hash() -> str:
    """A hash of every Python file of jaxrl_llm and kernels (the code a program is traced from; the benchmarks
    excepted)."""
    import jaxrl_llm
    import kernels

    h = hashlib.sha256()
    for pkg in (jaxrl_llm, kernels):
        root = os.path.dirname(pkg.__file__)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not (pkg is jaxrl_llm and d == "bench"))  # traces no program
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def _environment() -> str:
    import jaxlib

    dev = jax.devices()[0]
    return repr((jax.__version__, jaxlib.__version__,
                 dev.platform, getattr(dev, "device_kind", ""), dev.client.platform_version,
                 os.environ.get("XLA_FLAGS", ""), jax.process_index(), jax.process_count(),
                 jax.config.jax_default_matmul_precision, jax.config.jax_enable_x64))


def _describe(leaf) -> str:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"{tuple(leaf.shape)}:{leaf.dtype}:{getattr(leaf, 'sharding', None)}"
    return repr(leaf)


def default_dir() -> str | None:
    """`<jax's persistent cache dir>/jaxrl_engine`, or None where that cache is off or the backend is the CPU
    (an XLA:CPU executable loaded in another process can miss its kernels: "Function wrapped_broadcast not
    found"; jax's own cache still serves the CPU)."""
    base = jax.config.jax_compilation_cache_dir
    if not base or jax.devices()[0].platform == "cpu":
        return None
    return os.path.join(os.path.expanduser(base), SUBDIR)


class Programs:
    """Compiled executables of one engine, by name and input shapes (held once a process for every engine of
    the same config).

    Programs are kept under `<directory>/<engine key>/`, one folder per engine fingerprint. `preload` starts
    loading everything in that folder on background threads at once, so an engine built beside the trainer
    has its programs back before its first rollout asks for them.

    Args:
      fingerprint: what else decides the programs (the engine's config), as a string.
      devices: the devices the programs run on, in the mesh's order (a loaded program is placed on them).
      directory: where serialized executables are kept; None keeps them in memory only.
      threads: parallel builds and loads (default: the host's cores, at most 16).
    """

    def __init__(self, fingerprint: str, devices, directory: str | None = None, threads: int | None = None):
        self.devices = list(devices)
        self.threads = threads or min(16, os.cpu_count() or 1)
        ids = [d.id for d in self.devices]
        self._base = hashlib.sha256(f"{fingerprint}|{ids}|{source_hash()}|{_environment()}".encode()).hexdigest()
        self.directory = os.path.join(directory, self._base[:32]) if directory else None
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = _HELD_LOCK
        self.stats = dict(compiled=0, loaded=0, moved=0, compile_s=0.0, load_s=0.0, move_s=0.0)

    def key(self, name: str, args: tuple, static: dict) -> str:
        leaves, tree = jax.tree.flatten(args)
        text = f"{self._base}|{name}|{sorted(static.items())!r}|{tree}|{'|'.join(map(_describe, leaves))}"
        return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:40]}"

    def preload(self) -> None:
        """Starts loading every program kept for this engine, in the background; `get` waits for its own."""
        if not self.directory or not os.path.isdir(self.directory):
            return
        keys = [f[:-4] for f in sorted(os.listdir(self.directory)) if f.endswith(".bin")]
        with self._lock:
            keys = [k for k in keys if k not in _HELD and k not in self._pending]
            if not keys:
                return
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="programs")
            for k in keys:
                self._pending[k] = self._pool.submit(self._load, k)

    def finish_preload(self) -> int:
        """Waits for the background loads; returns how many programs they brought back."""
        with self._lock:
            pending = dict(self._pending)
        n = 0
        for key, future in pending.items():
            compiled = future.result()
            with self._lock:
                self._pending.pop(key, None)
                if compiled is not None:
                    _HELD[key] = compiled
                    n += 1
        return n

    def get(self, name: str, jitted, owner, args: tuple, static: dict, keep: bool = True):
        """The compiled `jitted(owner, *args, **static)` (a jax.jit method whose arg 0 is static), built or
        loaded on first use; call it with `args` alone (or arrays of the same shapes and shardings). `args` may
        be `jax.ShapeDtypeStruct`s with shardings. `keep=False`: never on disk (a program that compiles in
        milliseconds; XLA:CPU fails to run an argument-free one loaded back)."""
        key = self.key(name, args, static)
        with self._lock:
            hit = _HELD.get(key)
            pending = self._pending.get(key)
            building = _BUILDING.get(key)
            if hit is None and pending is None and building is None:  # this thread builds it; others wait
                _BUILDING[key] = mine = concurrent.futures.Future()
        if hit is not None:
            return hit
        if building is not None:
            return building.result()
        try:
            compiled = pending.result() if pending is not None else self._load(key) if keep else None
            if compiled is None:
                t0 = time.perf_counter()
                compiled = jitted.lower(owner, *args, **static).compile()
                with self._lock:
                    self.stats["compiled"] += 1
                    self.stats["compile_s"] += time.perf_counter() - t0
                if keep:
                    self._save(key, compiled)
        except BaseException as e:
            if pending is None:
                with self._lock:
                    _BUILDING.pop(key, None)
                mine.set_exception(e)
            raise
        with self._lock:
            _HELD[key] = compiled
            self._pending.pop(key, None)
            if pending is None:
                _BUILDING.pop(key, None)
        if pending is None:
            mine.set_result(compiled)
        return compiled

    def for_group(self, key: str, compiled, base_devices, devices):
        """The program `key` (`compiled`, built for `base_devices` in its mesh's order) loaded onto `devices` (as
        many, in the same order): the same executable running on another shard's devices. None where that
        cannot be done (the caller compiles for those devices instead)."""
        if list(base_devices) == list(devices):
            return compiled
        if devices[0].platform == "cpu":  # XLA:CPU loses kernels of a moved executable ("Function ... not found")
            return None
        key = f"{key}@{[d.id for d in devices]}"
        with self._lock:
            hit = _HELD.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        try:
            moved = _load_on(compiled, list(base_devices), list(devices))
        except Exception as e:  # noqa: BLE001 (a backend that cannot move an executable: compile per shard)
            log.warning("engine program could not be loaded onto %s (%s: %s); compiling it there", devices,
                        type(e).__name__, e)
            return None
        with self._lock:
            _HELD[key] = moved
            self.stats["moved"] += 1
            self.stats["move_s"] += time.perf_counter() - t0
        return moved

    def warm(self, items: list[tuple[str, object, object, tuple, dict]], context=contextlib.nullcontext) -> None:
        """Builds (or loads) every (name, jitted, owner, args, static) not yet held, on a thread pool.

        `context()` is entered in each thread (jax's mesh context is per thread)."""
        todo = [it for it in items if self.key(it[0], it[3], it[4]) not in _HELD]
        if not todo:
            return

        def build(item):
            with context():
                self.get(*item)

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(min(self.threads, len(todo))) as ex:
            for f in [ex.submit(build, it) for it in todo]:
                f.result()
        log.info("engine programs: %d ready in %.1f s (%d compiled, %d loaded from %s so far)", len(todo),
                 time.perf_counter() - t0, self.stats["compiled"], self.stats["loaded"], self.directory)

    def _path(self, key: str) -> str | None:
        return os.path.join(self.directory, key + ".bin") if self.directory else None

    def _load(self, key: str):
        path = self._path(key)
        if not path or not os.path.exists(path):
            return None
        from jax.experimental import serialize_executable

        t0 = time.perf_counter()
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree,
                                                                 backend=self.devices[0].client,
                                                                 execution_devices=self.devices)
        except Exception as e:  # noqa: BLE001 (a truncated or foreign file: rebuild it)
            log.warning("engine program %s could not be loaded (%s: %s); compiling it again", path,
                        type(e).__name__, e)
            return None
        with self._lock:
            self.stats["loaded"] += 1
            self.stats["load_s"] += time.perf_counter() - t0
        return compiled

    def _save(self, key: str, compiled) -> None:
        path = self._path(key)
        if not path:
            return
        from jax.experimental import serialize_executable

        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            os.makedirs(self.directory, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # readers never see a partial file
        except Exception as e:  # noqa: BLE001 (a full or read-only disk costs the next process a compile)
            log.warning("engine program %s not saved (%s: %s)", path, type(e).__name__, e)


# ---- one executable on another shard's devices -------------------------------------------------------------


def _load_on(compiled, base_devices: list, devices: list):
    """A new `jax.stages.Compiled` running `compiled`'s executable on `devices` instead of `base_devices`.

    jax's own serialization (`jax.experimental.serialize_executable`) writes the executable, its shardings and
    devices (devices by id); reading it back here maps each base device to its counterpart and deserializes the
    executable with a device assignment over the new devices, as jax's persistent cache does for a cached
    executable on other devices. Nothing is traced, lowered or compiled.
    """
    from jax._src import compiler  # the compile options jax builds for a device assignment
    from jax._src.lib import xla_client as xc
    from jax.experimental import serialize_executable

    blob, in_tree, out_tree = serialize_executable.serialize(compiled)
    mapping = {d.id: t for d, t in zip(base_devices, devices)}
    backend = devices[0].client
    options = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices),
                                           device_assignment=np.asarray([d.id for d in devices]).reshape(1, -1),
                                           backend=backend)

    class Remap(pickle.Unpickler):
        def persistent_load(self, pid):
            if pid[0] == "exec":
                return backend.deserialize_executable(pid[1], xc.DeviceList(tuple(devices)), options)
            if pid[0] == "device":
                return mapping[pid[1]]
            if pid[0] == "client":
                return backend
            raise pickle.UnpicklingError(f"unexpected persistent id {pid[0]!r}")

    unloaded, args_info_flat, no_kwargs = Remap(io.BytesIO(blob)).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree, no_kwargs=no_kwargs)
