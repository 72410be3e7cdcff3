"""Start-up phases: each is logged with a timestamp and duration, and exposed on /health while starting."""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger("pagedserve.startup")

_collection_paused = False


def pause_garbage_collection() -> None:
    """Called first thing by `serve`: start-up builds millions of objects (importing torch alone) and frees
    few, so the collector's passes over them are wasted; they cost ~0.4 s of a ~2.5 s import of torch and
    fastapi on the 2-core AVX2 box (8 interleaved runs). Collection resumes when start-up ends."""
    global _collection_paused
    if gc.isenabled():
        gc.disable()
        _collection_paused = True


def resume_garbage_collection() -> None:
    """After a paused start-up: what it built is kept out of every later pass (gc.freeze: shorter pauses
    while serving), and collection resumes. Nothing happens if start-up did not pause it."""
    global _collection_paused
    if _collection_paused:
        _collection_paused = False
        gc.freeze()
        gc.enable()


# preparing_weights: the loaded weights packed for the kernels (on a cold page cache the file's pages are read here)
PHASES = ("starting", "resolving", "validating", "planning", "loading_weights", "preparing_weights", "allocating_kv",
          "warming_up", "ready")


@dataclass
class PhaseRecord:
    name: str
    started_at: float  # seconds since the tracker's start
    duration_s: float | None = None


@dataclass
class StartupTracker:
    """Thread-safe record of where start-up is; `t0` is the process start (time.time() clock)."""

    t0: float = field(default_factory=time.time)
    phase: str = "starting"
    progress: float | None = None
    error: str | None = None
    history: list[PhaseRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.history.append(PhaseRecord("starting", self.elapsed()))

    def elapsed(self) -> float:
        return time.time() - self.t0

    def enter(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}")
        with self._lock:
            now = self.elapsed()
            last = self.history[-1]
            last.duration_s = now - last.started_at
            logger.info("phase %s done in %.2f s", last.name, last.duration_s)
            self.history.append(PhaseRecord(phase, now))
            self.phase, self.progress = phase, None
        if phase == "ready":
            resume_garbage_collection()
            logger.info("ready %.2f s after process start", now)
        else:
            logger.info("phase %s (%.2f s after process start)", phase, now)

    def set_progress(self, fraction: float, phase: str | None = None) -> None:
        """`fraction` of the current phase done; a `phase` other than the current one is entered first."""
        if phase is not None and phase != self.phase:
            self.enter(phase)
        with self._lock:
            previous = self.progress or 0.0
            self.progress = round(min(max(fraction, 0.0), 1.0), 3)
        # Log every 25 %, not every tensor.
        if int(self.progress * 4) > int(previous * 4):
            logger.info("%s %d%%", self.phase, int(self.progress * 100))

    def fail(self, message: str) -> None:
        with self._lock:
            self.error = message
            self.phase = "failed"
        resume_garbage_collection()
        logger.error("start-up failed in %.2f s: %s", self.elapsed(), message)

    @property
    def is_ready(self) -> bool:
        return self.phase == "ready"

    def snapshot(self) -> dict:
        with self._lock:
            body = {"status": "ready" if self.is_ready else "error" if self.error else "starting",
                    "phase": self.phase, "progress": self.progress, "elapsed_s": round(self.elapsed(), 3)}
            if self.error:
                body["error"] = self.error
            body["phases"] = [{"name": r.name, "started_at_s": round(r.started_at, 3),
                               "duration_s": None if r.duration_s is None else round(r.duration_s, 3)}
                              for r in self.history]
        return body
