"""The threads grammars compile on, where one slow grammar holds up no one else.

A compile cannot be interrupted (xgrammar runs it in C++ to the end; a 60,000-value enum took minutes). With one
worker, such a grammar made every later grammar wait past its time limit too. Here a few daemon threads take
jobs from one queue; a job still running after `timeout_s` is given up: its Future fails with the job's own
time-limit error at once (the request gets its 400, and the same grammar asked again finds that in the cache),
and a fresh thread takes the abandoned one's place. The abandoned thread retires when the compile returns,
handing a result it did reach to the job's `late_result` (the compiler caches it in place of the error: a
grammar that was slow only because the box was busy is not refused until a restart); at most `max_abandoned`
run at once (each keeps one core busy), past which a late job is left running on its worker. Daemon threads: a
server told to stop does not wait for a compile to end.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    future: Future
    fn: Callable[..., Any]
    args: tuple
    late_error: Callable[[], BaseException] | None  # the error a job past the time limit fails with
    late_result: Callable[[Any], None] | None = None  # given the result of a job that was given up on
    started: float = 0.0


class CompileWorkers:
    def __init__(self, num_workers: int, timeout_s: float | None, max_abandoned: int = 2,
                 name: str = "pagedserve-grammar") -> None:
        self.timeout_s = timeout_s
        self.max_abandoned = max_abandoned
        self._name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[threading.Thread, _Job] = {}
        self._abandoned: set[threading.Thread] = set()
        self._numbers = itertools.count()
        for _ in range(num_workers):
            self._spawn()
        if timeout_s is not None:
            threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True).start()

    @property
    def num_abandoned(self) -> int:
        return len(self._abandoned)

    def submit(self, fn: Callable[..., Any], *args: Any, late_error: Callable[[], BaseException] | None = None,
               late_result: Callable[[Any], None] | None = None) -> Future:
        """Run fn(*args) on a worker; `late_error` makes the job one the time limit applies to, and
        `late_result` is called with its result should it return one after it was given up on."""
        future: Future = Future()
        self._jobs.put(_Job(future, fn, args, late_error, late_result))
        return future

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name=f"{self._name}_{next(self._numbers)}", daemon=True).start()

    def _work(self) -> None:
        """Run jobs until retired. The job is an argument of _run, never a local here: a local would keep the last
        job, its Future and its result (a compiled grammar, 100+ MiB for a 20,000-value choice) alive while the
        worker waits for the next job, long after the request and the bounded cache let go of it (QA-G)."""
        while self._run(self._jobs.get()):
            pass

    def _run(self, job: _Job) -> bool:
        """Run one job and hand its outcome to its Future (or to late_result); False when this thread retires."""
        me = threading.current_thread()
        if not job.future.set_running_or_notify_cancel():
            return True
        job.started = time.monotonic()
        with self._lock:
            self._running[me] = job
        result, error = None, None
        try:
            result = job.fn(*job.args)
        except BaseException as exc:  # noqa: BLE001 - the job's outcome, handed to its Future
            error = exc
        with self._lock:
            del self._running[me]
            retire = me in self._abandoned
            self._abandoned.discard(me)
        try:
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)
        except InvalidStateError:  # given up on already: the time-limit error stands for this Future
            if error is None and job.late_result is not None:
                logger.info("a job given up on at the time limit returned after %.1f s",
                            time.monotonic() - job.started)
                job.late_result(result)
        return not retire

    def _watch(self) -> None:
        assert self.timeout_s is not None
        while True:
            time.sleep(min(0.1, self.timeout_s / 4))
            self._give_up_late_jobs()

    def _give_up_late_jobs(self) -> None:
        """Fail the Futures of jobs past the time limit. A function of its own so that its loop variables do not
        outlive it: left in _watch's frame, the last job looked at kept its compiled grammar alive (QA-G)."""
        assert self.timeout_s is not None
        now = time.monotonic()
        with self._lock:
            for thread, job in list(self._running.items()):
                if (thread in self._abandoned or job.late_error is None or now - job.started <= self.timeout_s
                        or len(self._abandoned) >= self.max_abandoned):
                    continue
                self._abandoned.add(thread)
                self._spawn()
                try:
                    job.future.set_exception(job.late_error())
                except InvalidStateError:
                    pass
                logger.warning("a grammar still compiling after %g s was given up (its compile runs on in the "
                               "background until it returns; %d such now)", self.timeout_s, len(self._abandoned))
