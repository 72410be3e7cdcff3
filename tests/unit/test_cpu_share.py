"""engine/cpu_share.py: fewer threads while other processes keep the CPUs busy, all of them again after."""

from __future__ import annotations

import pytest

from pagedserve.engine import cpu_share
from pagedserve.engine.cpu_share import CHECK_INTERVAL_S, STALE_S, CpuShare, CpuTimes, busy_seconds, read_times

STAT = """cpu  500 10 200 9000 40 5 5 30 0 0
cpu0 100 0 50 4000 20 1 1 10 7 0
cpu1 300 10 100 4000 20 2 3 20 0 0
cpu2 1000 0 0 0 0 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""


def test_busy_seconds_count_user_nice_system_irq_softirq_steal_of_the_cpus_asked():
    # cpu0: 100 + 0 + 50 + 1 + 1 + 10 = 162 ticks (idle, iowait and guest left out); cpu1: 300 + 10 + 100 + 2 + 3 + 20
    assert busy_seconds(STAT, [0], 100) == pytest.approx(1.62)
    assert busy_seconds(STAT, [0, 1], 100) == pytest.approx(1.62 + 4.35)
    assert busy_seconds(STAT, [1, 5], 100) == pytest.approx(4.35)  # a CPU with no line counts nothing
    assert busy_seconds(STAT, [], 100) == 0


def test_read_times_of_this_machine_grow_with_work(tmp_path):
    import os

    cpus = tuple(sorted(os.sched_getaffinity(0)))
    first = read_times(cpus)
    assert first is not None
    total = sum(i * i for i in range(300_000))  # some CPU time of this process
    second = read_times(cpus)
    assert total > 0 and second.own_s > first.own_s and second.wall_s > first.wall_s
    assert second.busy_s >= first.busy_s
    assert read_times(cpus, str(tmp_path / "missing")) is None


class Box:
    """A fake machine: `neighbours` CPUs busy with other processes and `own` CPUs with this one, per second."""

    def __init__(self) -> None:
        self.wall = self.busy = self.own_s = 0.0
        self.neighbours, self.own = 0.0, 2.0
        self.reads = 0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.busy += (self.neighbours + self.own) * seconds
        self.own_s += self.own * seconds

    def read(self) -> CpuTimes:
        self.reads += 1
        return CpuTimes(self.wall, self.busy, self.own_s)

    def clock(self) -> float:
        return self.wall


def run(share: CpuShare, box: Box, seconds: float, step_s: float = 0.125) -> list[int]:  # steps exact in binary
    counts = []
    for _ in range(round(seconds / step_s)):
        box.advance(step_s)
        counts.append(share.check())
    return counts


def test_gives_way_to_a_busy_neighbour_after_two_readings_and_comes_back_after_it_stops():
    box = Box()
    share = CpuShare(box.read, cpus=2, threads=2, clock=box.clock)
    assert CHECK_INTERVAL_S == 0.5  # a reading every 4 steps of 0.125 s
    assert run(share, box, 2.0) == [2] * 16  # quiet
    assert box.reads == 1 + 4  # the first at start, then one per interval, not one per step
    box.neighbours, box.own = 1.0, 1.0  # a process keeps one CPU busy
    counts = run(share, box, 2.0)
    # one reading (the 4th step) is not enough; the second in a row that agrees (the 8th) is
    assert counts == [2] * 7 + [1] * 9
    assert share.neighbours == pytest.approx(1.0)
    box.neighbours = 0.0  # it stopped
    assert run(share, box, 2.0) == [1] * 7 + [2] * 9


def test_a_neighbour_busy_for_one_reading_changes_nothing():
    box = Box()
    share = CpuShare(box.read, cpus=2, threads=2, clock=box.clock)
    run(share, box, 1.0)
    box.neighbours = 1.5
    run(share, box, CHECK_INTERVAL_S)  # one busy interval
    box.neighbours = 0.0
    assert run(share, box, 3.0) == [2] * 24


@pytest.mark.parametrize("neighbours,expected", [(0.0, 8), (0.4, 8), (0.6, 7), (2.2, 6), (6.6, 1), (9.0, 1)])
def test_threads_are_the_cpus_the_neighbours_leave_at_least_one_at_most_the_configured(neighbours, expected):
    box = Box()
    box.own = 1.0
    share = CpuShare(box.read, cpus=8, threads=8, clock=box.clock)
    box.neighbours = neighbours
    assert run(share, box, 2.0)[-1] == expected


def test_more_cpus_than_threads_a_neighbour_on_the_spare_ones_takes_nothing():
    # 4 logical CPUs (SMT), 2 threads: a neighbour on up to 2 CPUs leaves 2 for the threads
    box = Box()
    share = CpuShare(box.read, cpus=4, threads=2, clock=box.clock)
    box.neighbours = 2.0
    assert run(share, box, 2.0)[-1] == 2
    box.neighbours = 3.0
    assert run(share, box, 2.0)[-1] == 1


def test_readings_after_an_idle_gap_only_start_a_new_interval():
    box = Box()
    share = CpuShare(box.read, cpus=2, threads=2, clock=box.clock)
    box.neighbours = 2.0
    box.advance(STALE_S + 10)  # idle engine: no checks; the neighbour's old work says little about now
    assert share.check() == 2
    box.neighbours = 0.0
    assert run(share, box, 3.0) == [2] * 24


def test_no_reading_no_change():
    share = CpuShare(lambda: None, cpus=2, threads=2, clock=lambda: 100.0)
    assert share.check() == 2


def test_for_this_process_watches_only_where_there_is_a_count_to_change(monkeypatch):
    assert cpu_share.for_this_process(1) is None
    share = cpu_share.for_this_process(2)
    assert share is not None and share.configured == 2 and share.check() == 2
    monkeypatch.setattr(cpu_share, "read_times", lambda cpus, stat_path="/proc/stat": None)
    assert cpu_share.for_this_process(2) is None


def test_neighbours_now_is_a_share_of_this_process_s_cpus():
    import os

    seen = cpu_share.neighbours_now(0.05)
    assert seen is not None and 0.0 <= seen <= len(os.sched_getaffinity(0)) + 0.5  # (tick rounding)
