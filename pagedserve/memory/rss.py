"""Resident memory held to the plan while serving (#19 item 3): freed memory goes back to the OS, and RSS is
measured against what the plan expects now.

glibc keeps freed activation buffers: once a large buffer allocated with mmap is freed, its dynamic mmap
threshold rises to that size (up to 32 MiB), so the next buffers of that size come from an arena and stay
resident after free. malloc_trim(0) hands the arenas' free pages back (MADV_DONTNEED). The engine calls
ResidentMemory.after_step() after every step: after a step of LARGE_STEP_TOKENS or more it trims, at once when
the engine has nothing left to run and at most every TRIM_INTERVAL_S while it is busy (a trimmed heap pays
page faults again on the next step); going idle after smaller steps, it trims where the last trim is
TRIM_INTERVAL_S old. Tuning glibc instead (M_MMAP_THRESHOLD fixed low, MALLOC_ARENA_MAX) would
make every large buffer of every step an mmap + page faults + munmap.

What the plan expects now, with the pool allocated lazily (a block's pages become resident when first written,
and stay):
    expected = steady_bytes (weights + overhead + KV bookkeeping)
             + KV blocks written so far x block_bytes
             + activation_bytes (one step's peak: between trims the allocator may still hold it)
RSS is the process's, so where other engines live in the same process (a second `LLM` in a notebook, a benchmark
that compares two engines in one process) their weights, KV bookkeeping and blocks written (as of their last
reading) are added, and the runtime overhead and one step's activations count once (the largest): a lone engine's
figure is the one above. A warning is logged when RSS exceeds it by more than RSS_TOLERANCE, once per excursion;
/metrics and /health carry the last reading.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.memory.plan import MemoryPlan
from pagedserve.memory.probe import process_rss_bytes
from pagedserve.memory.sizes import MIB

logger = logging.getLogger(__name__)

RSS_TOLERANCE = 0.10  # warn when RSS exceeds the expected figure by more than this
LARGE_STEP_TOKENS = 256  # a step of at least this many tokens leaves activation buffers worth trimming
LARGE_FREE_BYTES = 16 * MIB  # memory freed outside the model step (compiled grammars) worth trimming
TRIM_INTERVAL_S = 5.0  # while busy, trim at most this often
MEASURE_INTERVAL_S = 1.0  # read VmRSS at most this often while busy (and after each trim, and going idle)

ENGINES: weakref.WeakSet[ResidentMemory] = weakref.WeakSet()  # every live engine's, this process's RSS holds all
_ENGINES_LOCK = threading.Lock()  # engines may start in other threads while one reads the set


def libc_malloc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0) as a callable, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library already loaded (no find_library subprocess)
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


@dataclass(frozen=True)
class RSSReading:
    rss_bytes: int
    expected_bytes: int
    kv_blocks_written: int
    window_blocks_written: int = 0  # the sliding-window layers' pool of their own (plan.num_window_blocks)

    @property
    def over_plan(self) -> float:
        """RSS relative to the expected figure: 0.10 means 10 % above it, negative below it."""
        return self.rss_bytes / self.expected_bytes - 1

    def to_dict(self) -> dict:
        return {"rss_bytes": self.rss_bytes, "expected_bytes": self.expected_bytes,
                "kv_blocks_written": self.kv_blocks_written, "window_blocks_written": self.window_blocks_written,
                "over_plan": round(self.over_plan, 4)}


class ResidentMemory:
    """Trims the heap after large steps and keeps the last RSS reading against the plan (see the module docstring)."""

    def __init__(self, plan: MemoryPlan, read_rss: Callable[[], int | None] = process_rss_bytes,
                 trim: Callable[[], object] | None = None, clock: Callable[[], float] = time.monotonic,
                 engines: weakref.WeakSet[ResidentMemory] | None = None) -> None:
        self.plan = plan
        self.engines = ENGINES if engines is None else engines  # this one's and the process's other engines'
        with _ENGINES_LOCK:
            self.engines.add(self)
        self.kv_blocks_written = self.window_blocks_written = 0  # as of the last reading
        self.read_rss = read_rss
        self.trim = trim
        self.clock = clock
        self.last: RSSReading | None = None
        self.num_trims = 0
        self._untrimmed = False  # a large step ran since the last trim
        self._last_trim = self._last_measure = float("-inf")
        self._warned = False

    def expected_bytes(self, kv_blocks_written: int, others: list[ResidentMemory] | None = None,
                       window_blocks_written: int = 0) -> int:
        """The process's expected RSS with `kv_blocks_written` blocks of this engine's pool written, and
        `window_blocks_written` of its window pool (`others`: the process's other engines, listed here when not
        given)."""
        others = self.others() if others is None else others
        plans = [self.plan] + [m.plan for m in others]
        return (self._held_bytes(kv_blocks_written, window_blocks_written) + self.others_bytes(others)
                + max(p.overhead_bytes for p in plans) + max(p.activation_bytes for p in plans))

    def others(self) -> list[ResidentMemory]:
        with _ENGINES_LOCK:
            engines = list(self.engines)
        return [m for m in engines if m is not self]

    @staticmethod
    def others_bytes(others: list[ResidentMemory]) -> int:
        """Other engines' weights, KV bookkeeping and KV blocks written, as of their last readings."""
        return sum(m._held_bytes(m.kv_blocks_written, m.window_blocks_written) for m in others)

    def _held_bytes(self, kv_blocks_written: int, window_blocks_written: int = 0) -> int:
        plan = self.plan
        return (plan.weight_bytes + plan.kv_bookkeeping_bytes + kv_blocks_written * plan.block_bytes
                + window_blocks_written * plan.window_block_bytes)

    def after_step(self, num_tokens: int, kv_blocks_written: int, is_idle: bool, window_blocks_written: int = 0,
                   freed_bytes: int = 0) -> None:
        """`freed_bytes`: memory freed by this step besides its own buffers (compiled grammars of requests that
        ended). Freed on the compile threads' arenas, it stays resident until a trim (537 MB after a 100,000-value
        choice, QA-G): LARGE_FREE_BYTES of it counts as a large step."""
        now = self.clock()
        self._untrimmed |= num_tokens >= LARGE_STEP_TOKENS or freed_bytes >= LARGE_FREE_BYTES
        due = now - self._last_trim >= TRIM_INTERVAL_S
        # Going idle trims whatever ran if the last trim is an interval old: small steps free buffers too (20-30 MiB
        # stayed resident at rest after a load whose large steps had all been trimmed while busy).
        trimmed = self.trim is not None and ((self._untrimmed and (is_idle or due)) or (is_idle and due))
        if trimmed:
            self.trim()
            self.num_trims += 1
            self._untrimmed, self._last_trim = False, now
        if trimmed or is_idle or now - self._last_measure >= MEASURE_INTERVAL_S:  # idle: /health at rest is current
            self._last_measure = now
            self.measure(kv_blocks_written, window_blocks_written)

    def measure(self, kv_blocks_written: int, window_blocks_written: int = 0) -> RSSReading | None:
        rss = self.read_rss()
        if rss is None:
            return None
        self.kv_blocks_written, self.window_blocks_written = kv_blocks_written, window_blocks_written
        others = self.others()
        self.last = RSSReading(rss, self.expected_bytes(kv_blocks_written, others, window_blocks_written),
                               kv_blocks_written, window_blocks_written)
        over = self.last.over_plan > RSS_TOLERANCE
        if over and not self._warned:
            also = (f" + {len(others)} other engine(s) in this process {self.others_bytes(others) / MIB:.0f} MiB"
                    if others else "")
            logger.warning("memory: RSS %.0f MiB is %.0f %% above the plan's %.0f MiB (steady %.0f MiB + %d KV"
                           " blocks written + one step's activations %.0f MiB%s)", rss / MIB,
                           100 * self.last.over_plan, self.last.expected_bytes / MIB, self.plan.steady_bytes / MIB,
                           kv_blocks_written, self.plan.activation_bytes / MIB, also)
        self._warned = over
        return self.last


def resident_memory_for(plan: MemoryPlan | None, device: str, kv_blocks_written: int,
                        window_blocks_written: int = 0) -> ResidentMemory | None:
    """The engine's ResidentMemory, with a first reading: on a CPU with a memory plan (a GPU's host memory is not
    what the plan counts)."""
    if plan is None or device != "cpu":
        return None
    memory = ResidentMemory(plan, trim=libc_malloc_trim())
    memory.measure(kv_blocks_written, window_blocks_written)
    return memory
