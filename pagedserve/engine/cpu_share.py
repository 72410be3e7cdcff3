"""Give way to busy neighbours on the CPU: fewer threads while other processes keep this process's cores busy.

The engine's parallel loops run in lockstep: a decode step is a few hundred OpenMP regions, each waiting for its
slowest thread. When another process keeps one of the cores busy, the OS scheduler runs it in turns with the
engine's thread there, and every region waits for that thread's next turn (a time slice: milliseconds). On the
2-vCPU Xeon, next to one busy process, SmolLM2-135M decoded ~45 tok/s on 2 threads and ~150 on 1; next to two, with
libgomp's default spin, 0.7 on 2 (benchmarks/RESULTS.md, "Next to a busy process"). Threads only on the CPUs the
neighbours leave free wait for no one's turn.

So, every CHECK_INTERVAL_S of steps, the engine reads how busy the CPUs it may run on were (/proc/stat's lines of
those CPUs, steal time included: a hypervisor's other guests are neighbours too) and how much of that was its own
process (its CPU time): the rest is the neighbours'. It runs round(CPUs - the neighbours' busy CPUs) threads, at
least 1 and at most the configured count, changed when two readings in a row agree (giving way makes room, so the
neighbour's share grows and the engine stays at fewer threads while the neighbour is busy; its threads come back
when the neighbour stops). Readings further apart than STALE_S (an idle engine) only start a new interval.

Off with --no-cpu-give-way, in batch-invariant mode (whose rows must not depend on how a step ran), with
tensor-parallel ranks (each rank is a process of its own) and on a GPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.5
STALE_S = 4 * CHECK_INTERVAL_S
AGREEING_READINGS = 2


@dataclass(frozen=True)
class CpuTimes:
    """A reading: seconds of wall clock, busy CPU seconds of the watched CPUs (all processes), and this
    process's CPU seconds."""
    wall_s: float
    busy_s: float
    own_s: float


def busy_seconds(stat_text: str, cpus: Iterable[int], ticks_per_second: float) -> float:
    """Busy seconds of `cpus` in /proc/stat's text: user, nice, system, irq, softirq and steal (guest time is in
    user already; idle and iowait are not busy)."""
    wanted, total = {f"cpu{c}" for c in cpus}, 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = [int(v) for v in rest.split()[:8]]
            fields += [0] * (8 - len(fields))
            user, nice, system, _idle, _iowait, irq, softirq, steal = fields
            total += user + nice + system + irq + softirq + steal
    return total / ticks_per_second


def read_times(cpus: tuple[int, ...], stat_path: str = "/proc/stat") -> CpuTimes | None:
    """A reading of the real machine, or None where /proc/stat cannot be read (not Linux)."""
    try:
        with open(stat_path) as f:
            text = f.read()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    return CpuTimes(time.monotonic(), busy_seconds(text, cpus, ticks), time.process_time())


def threads_to_run(cpus: int, neighbours: float, configured: int) -> int:
    """The rule: as many threads as the neighbours leave CPUs (rounded), at least 1, at most the configured count."""
    return max(1, min(configured, round(cpus - neighbours)))


class CpuShare:
    """How many threads the engine should run now, from readings taken at most every CHECK_INTERVAL_S.

    `read` gives a reading (None: none to be had); `cpus`: how many CPUs the readings cover; `threads`: the
    configured count, the most this ever says; `clock`: the readings' wall clock, looked at before each step (a
    reading, /proc/stat and the process's times, only when CHECK_INTERVAL_S has passed). Used from the engine
    thread only."""

    def __init__(self, read: Callable[[], CpuTimes | None], cpus: int, threads: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read, self.cpus, self.configured, self.clock = read, cpus, threads, clock
        self.threads = threads  # what the engine runs now
        self.neighbours = 0.0  # the neighbours' busy CPUs in the last interval
        self._last = read()
        self._pending: int | None = None  # a new count one reading said, waiting for the next to agree
        self._agreeing = 0

    def check(self, idle: bool = False) -> int:
        """The thread count to run the next step with (a new reading when CHECK_INTERVAL_S has passed). `idle`:
        read between steps of an idle server, whose changes are logged at DEBUG (a bursty neighbour flipped an
        idle server's count every few seconds: 34 INFO lines in 4 minutes without a request, QA-X)."""
        last = self._last
        if last is None or self.clock() - last.wall_s < CHECK_INTERVAL_S:
            return self.threads
        now = self.read()
        if now is None:
            return self.threads
        elapsed = now.wall_s - last.wall_s
        self._last = now
        if elapsed > STALE_S:  # idle in between: what the neighbours did then says little about now
            self._pending, self._agreeing = None, 0
            return self.threads
        self.neighbours = max(0.0, ((now.busy_s - last.busy_s) - (now.own_s - last.own_s)) / elapsed)
        wanted = threads_to_run(self.cpus, self.neighbours, self.configured)
        if wanted == self.threads:
            self._pending, self._agreeing = None, 0
            return self.threads
        self._agreeing = self._agreeing + 1 if wanted == self._pending else 1
        self._pending = wanted
        if self._agreeing >= AGREEING_READINGS:
            logger.log(logging.DEBUG if idle else logging.INFO,
                       "%s to %d CPU thread%s: other processes kept %.1f of the %d CPUs busy", "giving way" if
                       wanted < self.threads else "back", wanted, "" if wanted == 1 else "s", self.neighbours,
                       self.cpus)
            self.threads, self._pending, self._agreeing = wanted, None, 0
        return self.threads


def for_this_process(threads: int) -> CpuShare | None:
    """A CpuShare over the CPUs this process may run on, or None where there is nothing to adapt (one thread) or
    no /proc/stat to read."""
    if threads <= 1:
        return None
    try:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return None
    if read_times(cpus) is None:
        return None
    return CpuShare(lambda: read_times(cpus), len(cpus), threads)


def neighbours_now(seconds: float = 0.3) -> float | None:
    """How many of this process's CPUs other processes keep busy, over the next `seconds` (doctor's look), or None
    where /proc/stat cannot be read."""
    try:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:
        return None
    first = read_times(cpus)
    time.sleep(seconds)
    last = read_times(cpus)
    if first is None or last is None:
        return None
    return max(0.0, ((last.busy_s - first.busy_s) - (last.own_s - first.own_s)) / (last.wall_s - first.wall_s))
