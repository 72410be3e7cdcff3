"""Give way under memory pressure (#19 item 4): when something else on the box grows and the memory available
to this process (MemAvailable, or the cgroup's limit minus its working set) falls below a threshold, the server
stops admitting new sequences (HTTP 503 with Retry-After), the scheduler holds its waiting queue (running
sequences go on and finish; nothing admitted is dropped), and every free KV block's pages go back to the OS
(the prefix cache is forgotten: its blocks are free, only their hashes made them reusable). Serving resumes
when the headroom is back above a higher threshold (hysteresis, so that admission does not flap).

Thresholds, from the memory the probe saw at start (`total`: MemTotal, or the cgroup limit where it binds):
    low  = max(PRESSURE_MIN_BYTES (256 MiB), PRESSURE_FRACTION (5 %) x total)   under it: pressure
    high = 2 x low                                                              at or above it: pressure over
(the kernel starts reclaiming page cache well above its min watermark, which is far below 5 % on boxes of a
few GiB; 5 % leaves the neighbour that grew room to finish before it swaps.) Where the plan's worst case leaves
less than 2 x low of the memory seen at start (a small cgroup), low is half of what it leaves (at least
PRESSURE_FLOOR_BYTES): a server alone in the box must not put itself under pressure by growing as planned. And a
server that runs nothing and has no free block left to give back while the headroom is at or above low admits
again without waiting for high: alone in the box it would wait for ever (QA-S saw a server hold its queue for
minutes on its own steady memory).

The KV pool is a shared anonymous mapping (platform.lazy_zeros), so its pages are freed with
madvise(MADV_REMOVE), which also reads them back as zeros (MADV_DONTNEED would only unmap them: the shmem
pages and their contents stay). Whole pages only: a block's bytes need not be page-aligned.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pagedserve.memory.probe import AvailableMemory, available_memory
from pagedserve.memory.sizes import MIB

logger = logging.getLogger(__name__)

PRESSURE_MIN_BYTES = 256 * MIB
PRESSURE_FLOOR_BYTES = 32 * MIB  # low never goes under this, whatever the plan leaves
PRESSURE_FRACTION = 0.05
CHECK_INTERVAL_S = 0.5  # read the headroom at most this often
RETRY_AFTER_S = 5  # what a refused client is told to wait
PAGE_BYTES = 4096
MADV_REMOVE = 9


@dataclass(frozen=True)
class PressureThresholds:
    low_bytes: int  # headroom below this: under pressure
    high_bytes: int  # headroom at or above this: pressure over

    @classmethod
    def for_memory(cls, total_bytes: int, spare_bytes: int | None = None) -> PressureThresholds:
        """`spare_bytes`: what the plan's worst case leaves of the memory seen at start (see the module docstring)."""
        low = max(PRESSURE_MIN_BYTES, int(PRESSURE_FRACTION * total_bytes))
        if spare_bytes is not None and 2 * low > spare_bytes:
            low = max(PRESSURE_FLOOR_BYTES, spare_bytes // 2)
        return cls(low, 2 * low)


class MemoryPressure:
    """Whether the box is short of memory now, from a headroom source read at most every CHECK_INTERVAL_S.

    Thread-safe: the engine thread checks before each step, the HTTP thread before admitting a request (so a
    pressure that ends while the engine is idle is seen)."""

    def __init__(self, read_available: Callable[[], AvailableMemory], thresholds: PressureThresholds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read_available = read_available
        self.thresholds = thresholds
        self.clock = clock
        self.is_active = False
        self.available_bytes: int | None = None
        self.num_episodes = 0
        self.num_reads = 0
        self._released_at_read = -1  # the reading after which free blocks were last released
        self._last_check = float("-inf")
        self._lock = threading.Lock()

    def check(self) -> bool:
        """Read the headroom if it is due; True while under pressure."""
        with self._lock:
            now = self.clock()
            if now - self._last_check >= CHECK_INTERVAL_S:
                self._last_check = now
                self.num_reads += 1
                self._update(self.read_available())
            return self.is_active

    def take_release_turn(self) -> bool:
        """True once per reading of the headroom while under pressure: when to release free blocks again (each
        release walks the written blocks, so not every step)."""
        with self._lock:
            due = self.is_active and self._released_at_read != self.num_reads
            if due:
                self._released_at_read = self.num_reads
            return due

    def relent(self) -> bool:
        """End the pressure where the headroom is at least low (the caller runs nothing and has nothing left to give
        back: waiting for high may never end); True if it ended."""
        with self._lock:
            if not self.is_active or self.available_bytes is None or self.available_bytes < self.thresholds.low_bytes:
                return False
            self.is_active = False
        logger.warning("memory_pressure over: %.0f MiB available (>= %.0f MiB), and the server runs nothing and has "
                       "nothing more to give back: admitting again", self.available_bytes / MIB,
                       self.thresholds.low_bytes / MIB)
        return True

    def _update(self, available: AvailableMemory) -> None:
        self.available_bytes = available.num_bytes
        low, high = self.thresholds.low_bytes, self.thresholds.high_bytes
        if not self.is_active and available.num_bytes < low:
            self.is_active = True
            self.num_episodes += 1
            logger.warning("memory_pressure: %.0f MiB available (%s), below %.0f MiB: not admitting new sequences,"
                           " releasing the free KV blocks' pages", available.num_bytes / MIB, available.bound_by,
                           low / MIB)
        elif self.is_active and available.num_bytes >= high:
            self.is_active = False
            logger.warning("memory_pressure over: %.0f MiB available (>= %.0f MiB): admitting again",
                           available.num_bytes / MIB, high / MIB)

    def report(self) -> dict:
        """For /health."""
        return {"active": self.is_active, "available_bytes": self.available_bytes,
                "low_bytes": self.thresholds.low_bytes, "high_bytes": self.thresholds.high_bytes,
                "episodes": self.num_episodes}


def give_way(pressure: MemoryPressure, scheduler: Any, kv: Any,
             release: Callable[[list[int], int, list[int]], int]) -> int:
    """Before an engine step: while under pressure, hold the scheduler's waiting queue and free the pages of
    every free KV block (`kv`, the KVCacheManager, marks them unwritten, so the RSS expectation drops with
    them; `release(block_ids, block_size, window_block_ids)`: the runner's Runner.release_kv_pages, every pool
    on every rank). Returns the number of blocks released. Running nothing with nothing left to release, it
    relents where the headroom is at least low (MemoryPressure.relent)."""
    scheduler.hold_waiting = pressure.check()
    if not pressure.take_release_turn():
        return 0
    num_blocks = release_free_kv(kv, release, "memory_pressure")
    if not num_blocks and not scheduler.running and pressure.relent():
        scheduler.hold_waiting = False
    return num_blocks


def release_free_kv(kv: Any, release: Callable[[list[int], int, list[int]], int], why: str) -> int:
    """Free the pages of every free KV block (`kv`, the KVCacheManager, marks them unwritten and forgets their
    cached prefixes; `release`: the runner's release_kv_pages) and log it with `why`; the number of blocks."""
    block_ids, window_block_ids = kv.release_free_blocks()
    num_blocks = len(block_ids) + len(window_block_ids)
    if num_blocks:
        released = release(block_ids, kv.block_size, window_block_ids)
        logger.info("%s: gave back %.1f MiB of %d free KV blocks", why, released / MIB, num_blocks)
    return num_blocks


def page_ranges(block_ids: Iterable[int], block_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the whole pages inside runs of consecutive blocks, from the pool's start."""
    ranges = []
    ids = sorted(block_ids)
    first = 0
    for i in range(1, len(ids) + 1):
        if i < len(ids) and ids[i] == ids[i - 1] + 1:
            continue
        start = -(-ids[first] * block_bytes // PAGE_BYTES) * PAGE_BYTES  # round up to a page
        end = (ids[i - 1] + 1) * block_bytes // PAGE_BYTES * PAGE_BYTES  # round down
        if end > start:
            ranges.append((start, end - start))
        first = i
    return ranges


def release_block_pages(kv_caches: list[Any], block_ids: list[int], block_size: int) -> int:
    """madvise(MADV_REMOVE) the whole pages of these blocks in every layer's K and V pool; bytes released."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    released = 0
    for cache in kv_caches:
        for pool in (cache.k, cache.v):  # [num_slots, kv_heads, head_dim], contiguous, page-aligned start
            block_bytes = block_size * pool.stride(0) * pool.element_size()
            for offset, length in page_ranges(block_ids, block_bytes):
                if madvise(pool.data_ptr() + offset, length, MADV_REMOVE) == 0:
                    released += length
    return released


def memory_pressure_for(device: str, plan: Any, meminfo_path: str | None = None) -> MemoryPressure | None:
    """The server's monitor on a CPU, thresholds from the memory the plan saw at start; `meminfo_path` (testing)
    reads a simulated MemAvailable instead of /proc/meminfo."""
    if device != "cpu" or plan is None:
        return None
    start = plan.request.available
    thresholds = PressureThresholds.for_memory(start.total_bytes or start.num_bytes, start.num_bytes - plan.total_bytes)
    if thresholds.low_bytes < PRESSURE_MIN_BYTES:
        logger.info("memory_pressure: below %.0f MiB of headroom (over again at %.0f MiB): the plan's worst case "
                    "leaves %.0f MiB of what is available", thresholds.low_bytes / MIB, thresholds.high_bytes / MIB,
                    (start.num_bytes - plan.total_bytes) / MIB)
    return MemoryPressure(lambda: available_memory(meminfo_path or "/proc/meminfo"), thresholds)
