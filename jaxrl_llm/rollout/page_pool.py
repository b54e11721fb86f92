"""The paged sampler's KV memory: a host-side page allocator and the budget that sizes it.

The device holds, per layer, K/V pools of `num_pages` pages of `page_size` tokens each
([K, P, ps, H], rollout/paged_decode.py). This module owns which page belongs to whom: free lists,
reference counts (the `n` samples of a prompt share its prompt pages; a shared page is copied before
anyone writes into it) and epochs (a page freed and handed out again gets a new epoch, so a stale
reference to it is detected). Nothing here touches the device.

With several data-parallel shards the pool is split into equal page ranges, one per shard; a row's
pages all come from the shard that decodes it. Page 0 of every shard is a scratch page: unused block
table entries point at it, and rows that have finished write their (discarded) K/V there.

Glossary: P pages, ps page size, K kv heads, H head dim, L layers.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np

log = logging.getLogger(__name__)


class PagePool:
    """Free lists and reference counts of `num_pages` pages split over `shards` equal ranges."""

    def __init__(self, num_pages: int, page_size: int, shards: int = 1):
        if num_pages % shards:
            raise ValueError(f"num_pages {num_pages} must split evenly over {shards} shards")
        self.num_pages, self.page_size, self.shards = num_pages, page_size, shards
        self.per_shard = num_pages // shards
        if self.per_shard < 2:
            raise ValueError(f"{num_pages} pages over {shards} shards leaves no usable page (one is scratch)")
        self.refcount = np.zeros(num_pages, np.int32)
        self.epoch = np.zeros(num_pages, np.int64)
        # Stacks popped from the end: the lowest free page is handed out first (deterministic, and
        # every process of a multi-process run makes the same choice).
        self._free = [list(range((s + 1) * self.per_shard - 1, s * self.per_shard, -1)) for s in range(shards)]

    def scratch(self, shard: int = 0) -> int:
        return shard * self.per_shard

    def usable(self) -> int:
        """Pages a shard can hand out (its scratch page excluded)."""
        return self.per_shard - 1

    def num_free(self, shard: int = 0) -> int:
        return len(self._free[shard])

    def shard_of(self, page: int) -> int:
        return page // self.per_shard

    def alloc(self, shard: int, count: int) -> list[int]:
        """`count` fresh pages of `shard` (refcount 1); the caller checked `num_free` first."""
        free = self._free[shard]
        if count > len(free):
            raise RuntimeError(f"page pool shard {shard}: asked for {count} pages, {len(free)} free")
        pages = [free.pop() for _ in range(count)]
        self.refcount[pages] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise RuntimeError(f"page {p} shared after it was freed")
            self.refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drops one reference to each page; pages that reach zero go back to their shard's free list."""
        for p in pages:
            if self.refcount[p] < 1:
                raise RuntimeError(f"page {p} released more often than it was taken")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.epoch[p] += 1
                self._free[self.shard_of(p)].append(p)

    def in_use(self) -> int:
        return int((self.refcount > 0).sum())


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V of one token over every layer (all kv heads)."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


@dataclasses.dataclass(frozen=True)
class KvBudget:
    """How the pool was sized (logged, and returned in the engine's stats)."""

    num_pages: int  # over all data-parallel shards
    page_bytes: int  # one page on one device (its share of the kv heads)
    source: str  # "kv_cache_memory_bytes", "gpu_memory_utilization" or "unbounded"
    device_limit: int = 0  # bytes the allocator may use on one device (0: unknown)
    in_use: int = 0  # bytes already held on one device when the pool was sized
    workspace: int = 0  # bytes set aside for the decode and prefill temporaries


def device_memory(device: jax.Device | None = None) -> tuple[int, int, int] | None:
    """(limit, in use, peak in use) bytes of a device's allocator, or None where it keeps no statistics (CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (backends without statistics raise or return None)
        stats = None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)), int(stats.get("peak_bytes_in_use", 0))


def size_pool(*, page_bytes: int, shards: int, workspace: int, gpu_memory_utilization: float,
              kv_cache_memory_bytes: int | None, unbounded_pages: int) -> KvBudget:
    """Pages per the budget: an explicit byte size (per device), or the share of the device's memory that
    total use may reach, less what is already held and the workspace; `unbounded_pages` (a pool for
    every row at full length) where the device reports no memory statistics and no size is given."""
    if kv_cache_memory_bytes is not None:
        per_shard = int(kv_cache_memory_bytes) // page_bytes
        return KvBudget(per_shard * shards, page_bytes, "kv_cache_memory_bytes")
    mem = device_memory()
    if mem is None:
        per_shard = -(-unbounded_pages // shards)
        return KvBudget(per_shard * shards, page_bytes, "unbounded")
    limit, in_use, _ = mem
    free = gpu_memory_utilization * limit - in_use - workspace
    per_shard = max(0, math.floor(free / page_bytes))
    return KvBudget(per_shard * shards, page_bytes, "gpu_memory_utilization", limit, in_use, workspace)
