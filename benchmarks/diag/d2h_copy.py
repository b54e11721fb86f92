"""Diagnostics: where a checkpoint's device-to-host copy goes. The 7B full-state save made its step wait 80.4 s for
91.4 GB over 4 GPUs (1.1 GB/s; BENCHMARKS.md, issue 41), all of it Orbax's copy of the states to host memory
before its write thread takes over. Orbax (0.12.3 on) copies each shard with `jax.device_put` into the device's
`pinned_host` memory where the device has one, and reads it back with `np.asarray`. This times, on one device, for
arrays of `GB` gigabytes in all (bf16 and fp32 leaves of `LEAF_MB` megabytes, as a train state's):

  pinned_1, pinned_2   device_put to pinned_host, every leaf at once then waited for, twice (does the first pay
                       for pinning the host buffers?), then np.asarray of the results
  pageable             copy_to_host_async of every leaf, then np.asarray (Orbax's path without pinned memory)
  serial               np.asarray leaf by leaf (one transfer at a time)

Each row prints the copy's seconds and GB/s (for `pageable`, the copies and the np.asarray that waits on them) and
the seconds of the np.asarray after it. Random values (never zeros).

    python benchmarks/diag/d2h_copy.py [GB] [LEAF_MB]      # defaults 8 and 256
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def leaves(total_gb: float, leaf_mb: int) -> list[jax.Array]:
    out, key, left = [], jax.random.key(0), int(total_gb * 1e9)
    while left > 0:
        key, k = jax.random.split(key)
        dtype = jnp.bfloat16 if len(out) % 3 == 0 else jnp.float32  # a third bf16 weights, the rest fp32 state
        n = min(left, leaf_mb << 20) // jnp.dtype(dtype).itemsize
        out.append(jax.random.normal(k, (n,), dtype))
        left -= n * jnp.dtype(dtype).itemsize
    jax.block_until_ready(out)
    return out


def report(name: str, gb: float, copy_s: float, read_s: float) -> None:
    print(f"{name:<10} {gb:6.2f} GB  copy {copy_s:7.2f} s ({gb / max(copy_s, 1e-9):6.2f} GB/s)  "
          f"np.asarray after {read_s:6.2f} s", flush=True)


def main(total_gb: float, leaf_mb: int) -> None:
    xs = leaves(total_gb, leaf_mb)
    gb = sum(x.nbytes for x in xs) / 1e9
    device = xs[0].devices().pop()
    kinds = [m.kind for m in device.addressable_memories()]
    print(f"{device.device_kind}: {len(xs)} leaves, {gb:.2f} GB; memory kinds {kinds}", flush=True)
    if "pinned_host" in kinds:
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        for rep in (1, 2):
            t0 = time.perf_counter()
            host = [jax.device_put(x, pinned) for x in xs]
            jax.block_until_ready(host)
            t1 = time.perf_counter()
            arrays = [np.asarray(h) for h in host]
            report(f"pinned_{rep}", gb, t1 - t0, time.perf_counter() - t1)
            del host, arrays
    t0 = time.perf_counter()
    for x in xs:
        x.copy_to_host_async()
    t1 = time.perf_counter()
    arrays = [np.asarray(x) for x in xs]
    report("pageable", gb, time.perf_counter() - t0, time.perf_counter() - t1)
    del arrays
    ys = [x + 1 for x in xs]  # fresh buffers: the host copies above are cached on their arrays
    jax.block_until_ready(ys)
    t0 = time.perf_counter()
    for y in ys:
        np.asarray(y)
    report("serial", gb, time.perf_counter() - t0, 0.0)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 8.0, int(sys.argv[2]) if len(sys.argv) > 2 else 256)
