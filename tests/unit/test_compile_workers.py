"""structured/workers.py: a job past the time limit is given up at once and a fresh thread takes its place, so
one grammar that compiles for minutes holds up no other; the abandoned thread retires when its job returns."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from pagedserve.structured.workers import CompileWorkers


class Late(Exception):
    pass


def test_a_late_job_is_given_up_and_the_others_go_on():
    workers = CompileWorkers(1, timeout_s=0.2)
    release = threading.Event()
    slow = workers.submit(release.wait, late_error=lambda: Late("too slow"))
    quick = workers.submit(lambda: "done", late_error=lambda: Late("too slow"))
    start = time.monotonic()
    with pytest.raises(Late):
        slow.result(timeout=5)
    assert quick.result(timeout=5) == "done"  # ran on the fresh thread, not behind the slow one
    assert time.monotonic() - start < 2 and workers.num_abandoned == 1
    release.set()  # the abandoned job returns: its result is dropped, its thread retires
    deadline = time.monotonic() + 5
    while workers.num_abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert workers.num_abandoned == 0
    with pytest.raises(Late):
        slow.result(timeout=0)
    assert workers.submit(lambda: 7).result(timeout=5) == 7


def test_a_result_reached_after_the_limit_goes_to_late_result_and_errors_do_not():
    workers = CompileWorkers(2, timeout_s=0.1)
    release = threading.Event()
    late: list = []

    def job(value):
        release.wait(5)
        if value == "bad":
            raise ValueError(value)
        return value

    given_up = [workers.submit(job, v, late_error=lambda: Late("slow"), late_result=late.append) for v in ("ok", "bad")]
    for future in given_up:
        with pytest.raises(Late):
            future.result(timeout=5)
    assert late == []
    release.set()
    deadline = time.monotonic() + 5
    while workers.num_abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late == ["ok"]  # the Future keeps its time-limit error; only the result reached is handed on
    assert workers.submit(job, "on time", late_result=late.append).result(timeout=5) == "on time"
    assert late == ["ok"]


def test_at_most_max_abandoned_threads_and_only_jobs_with_a_time_limit():
    workers = CompileWorkers(1, timeout_s=0.1, max_abandoned=1)
    release = threading.Event()
    first = workers.submit(release.wait, late_error=lambda: Late("1"))
    with pytest.raises(Late):
        first.result(timeout=5)
    second = workers.submit(release.wait, late_error=lambda: Late("2"))
    time.sleep(0.5)
    assert not second.done() and workers.num_abandoned == 1  # past the cap: left running on its worker
    unlimited = CompileWorkers(1, timeout_s=0.1)
    gate = unlimited.submit(release.wait)  # no late_error: never given up
    time.sleep(0.4)
    assert not gate.done() and unlimited.num_abandoned == 0
    release.set()
    assert second.result(timeout=5) is True and gate.result(timeout=5) is True


def test_worker_threads_do_not_keep_the_process_alive():
    CompileWorkers(2, timeout_s=1.0, name="test-daemon")
    threads = [t for t in threading.enumerate() if t.name.startswith("test-daemon")]
    assert len(threads) == 3 and all(t.daemon for t in threads)  # two workers and the watch


class Result:
    pass


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_worker_keeps_no_reference_to_its_last_result(timeout_s):
    """Once the caller drops the Future, the result is freed while the workers wait for their next job: the
    worker's loop and the time-limit watcher held the last job (a compiled grammar of 100+ MiB, QA-G)."""
    workers = CompileWorkers(2, timeout_s=timeout_s)
    future = workers.submit(Result, late_error=lambda: Late("too slow"))
    result = weakref.ref(future.result(timeout=5))
    del future
    deadline = time.monotonic() + 5
    while result() is not None and time.monotonic() < deadline:
        time.sleep(0.2)  # the watcher's loop looks at running jobs every 0.1 s
        gc.collect()
    assert result() is None
