"""The paged sampler's KV memory: a host-side page allocator and the budget that sizes it.

The device holds, per layer, K/V pools of `num_pages` pages of `page_size` tokens each
([K, P, ps, H], rollout/paged_decode.py). This module owns which page belongs to whom: free lists,
reference counts (the `n` samples of a prompt share its prompt pages; a shared page is copied before
anyone writes into it) and epochs (a page freed and handed out again gets a new epoch, so a stale
reference to it is detected). Nothing here touches the device.

Each data-parallel shard of the engine is an engine of its own (rollout/shard.py), with a pool of its own on
its devices: a `PagePool` is one shard's. Page 0 is a scratch page: unused block-table entries point at it,
and rows that have finished write their (discarded) K/V there.

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
    """Free list, reference counts and epochs of one engine's `num_pages` pages (page 0 is scratch).

    Every operation takes and returns numpy arrays, so a segment's allocations and releases cost a few array
    operations whatever the number of rows.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a pool of {num_pages} page(s) leaves no usable page (page 0 is scratch)")
        self.num_pages, self.page_size = num_pages, page_size
        self.refcount = np.zeros(num_pages, np.int32)
        self.epoch = np.zeros(num_pages, np.int64)
        # A stack popped from the end: the lowest free page is handed out first (deterministic, so every process
        # driving the same shard makes the same choice).
        self._free = np.arange(num_pages - 1, 0, -1, dtype=np.int32)
        self._nfree = num_pages - 1

    @property
    def scratch(self) -> int:
        return 0

    def usable(self) -> int:
        """Pages the pool can hand out (the scratch page excluded)."""
        return self.num_pages - 1

    def num_free(self) -> int:
        return self._nfree

    def alloc(self, count: int) -> np.ndarray:
        """[count] fresh pages (refcount 1); the caller checked `num_free` first."""
        if count > self._nfree:
            raise RuntimeError(f"page pool: asked for {count} pages, {self._nfree} free")
        pages = self._free[self._nfree - count: self._nfree][::-1].copy()
        self._nfree -= count
        self.refcount[pages] = 1
        return pages

    def share(self, pages) -> None:
        pages = np.asarray(pages, np.int64)
        if pages.size and np.any(self.refcount[pages] < 1):
            raise RuntimeError(f"pages {pages[self.refcount[pages] < 1].tolist()} shared after they were freed")
        np.add.at(self.refcount, pages, 1)

    def release(self, pages) -> None:
        """Drops one reference to each page; pages that reach zero go back to the free list."""
        pages = np.asarray(pages, np.int64)
        if not pages.size:
            return
        np.subtract.at(self.refcount, pages, 1)
        if np.any(self.refcount[pages] < 0):
            raise RuntimeError("a page was released more often than it was taken")
        freed = np.unique(pages[self.refcount[pages] == 0])
        self.epoch[freed] += 1
        # Highest first on the stack, so the lowest freed page is handed out next.
        self._free[self._nfree: self._nfree + freed.size] = freed[::-1]
        self._nfree += freed.size

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

    num_pages: int  # pages of one shard's pool (every shard has as many)
    page_bytes: int  # one page on one device (its share of the kv heads)
    source: str  # "kv_cache_memory_bytes", "gpu_memory_utilization" or "unbounded"
    device_limit: int = 0  # bytes the allocator may use on one device (0: unknown)
    in_use: int = 0  # bytes already held on one device when the pool was sized
    workspace: int = 0  # bytes set aside for the decode and prefill temporaries
    state_slots: int = 0  # a linear-attention model's state slots a shard (scratch included; 0: none)
    slot_cap: int = 0  # the rows a shard decodes at most, where state slots bound them (0: max_num_seqs)


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


def size_pool(*, page_bytes: int, workspace: int, gpu_memory_utilization: float, kv_cache_memory_bytes: int | None,
              unbounded_pages: int, device: jax.Device | None = None) -> KvBudget:
    """One shard's pages per the budget: an explicit byte size (per device), or the share of the device's memory
    that total use may reach, less what is already held and the workspace; `unbounded_pages` (a pool for every
    row at full length) where the device reports no memory statistics and no size is given."""
    if kv_cache_memory_bytes is not None:
        return KvBudget(int(kv_cache_memory_bytes) // page_bytes, page_bytes, "kv_cache_memory_bytes")
    mem = device_memory(device)
    if mem is None:
        return KvBudget(int(unbounded_pages), page_bytes, "unbounded")
    limit, in_use, _ = mem
    free = gpu_memory_utilization * limit - in_use - workspace
    return KvBudget(round_pages(max(0, math.floor(free / page_bytes))), page_bytes, "gpu_memory_utilization", limit,
                    in_use, workspace)


def round_pages(pages: int, bits: int = 8) -> int:
    """`pages` rounded down to its leading `bits` bits (at most 1/2**(bits-1) less): a pool sized from free memory
    keeps one shape, and so one set of programs, when what is in use moves by a little between runs."""
    step = 1 << max(0, pages.bit_length() - bits)
    return pages // step * step
