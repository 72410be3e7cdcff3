"""Giving way under memory pressure (memory/pressure.py) with a simulated headroom source and clock."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pagedserve.memory import pressure
from pagedserve.memory.pressure import MemoryPressure, PressureThresholds, page_ranges
from pagedserve.memory.probe import GIB, AvailableMemory

MIB = 1 << 20


def test_thresholds_are_five_percent_of_the_box_at_least_256_mib() -> None:
    low = int(0.05 * 24 * GIB)
    assert PressureThresholds.for_memory(24 * GIB) == PressureThresholds(low, 2 * low)
    assert PressureThresholds.for_memory(2 * GIB) == PressureThresholds(256 * MIB, 512 * MIB)


class Source:
    def __init__(self, num_bytes: int) -> None:
        self.num_bytes, self.now, self.reads = num_bytes, 0.0, 0

    def read(self) -> AvailableMemory:
        self.reads += 1
        return AvailableMemory(self.num_bytes, "MemAvailable", "simulated")

    def monitor(self) -> MemoryPressure:
        return MemoryPressure(self.read, PressureThresholds(100 * MIB, 200 * MIB), clock=lambda: self.now)


def test_pressure_starts_below_low_and_ends_at_high(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pagedserve.memory.pressure")
    source = Source(500 * MIB)
    monitor = source.monitor()
    readings = []
    for available in (500, 99, 150, 199, 200, 150, 90):  # MiB, one check interval apart
        source.num_bytes = available * MIB
        readings.append(monitor.check())
        source.now += pressure.CHECK_INTERVAL_S
    assert readings == [False, True, True, True, False, False, True]
    assert monitor.num_episodes == 2 and monitor.report()["available_bytes"] == 90 * MIB
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["memory_pressure", "memory_pressure over",
                                                                       "memory_pressure"]


def test_headroom_is_read_at_most_every_interval() -> None:
    source = Source(50 * MIB)
    monitor = source.monitor()
    assert monitor.check() and monitor.check()
    source.num_bytes = GIB
    assert monitor.check() and source.reads == 1  # not due yet
    source.now += pressure.CHECK_INTERVAL_S
    assert not monitor.check() and source.reads == 2


def test_give_way_holds_the_queue_and_releases_free_blocks_only_while_short() -> None:
    released = []
    kv = SimpleNamespace(release_free_blocks=lambda: ([3, 4], [5]), block_size=16)
    scheduler = SimpleNamespace(hold_waiting=False)
    release = lambda ids, block_size, window_ids: released.append((ids, block_size, window_ids)) or 4096  # noqa: E731
    source = Source(GIB)
    monitor = source.monitor()
    pressure.give_way(monitor, scheduler, kv, release)
    assert scheduler.hold_waiting is False and released == []
    source.num_bytes, source.now = 10 * MIB, 1.0
    pressure.give_way(monitor, scheduler, kv, release)
    assert scheduler.hold_waiting is True and released == [([3, 4], 16, [5])]
    pressure.give_way(monitor, scheduler, kv, release)
    assert scheduler.hold_waiting is True and len(released) == 1  # once per reading of the headroom
    source.now += pressure.CHECK_INTERVAL_S
    pressure.give_way(monitor, scheduler, kv, release)
    assert len(released) == 2


@pytest.mark.parametrize("block_ids,block_bytes,expected", [
    ([0, 1], 6144, [(0, 12288)]),  # two blocks: three whole pages
    ([1], 6144, [(8192, 4096)]),  # bytes 6144..12288: the page at 8192 only
    ([1, 2, 5], 6144, [(8192, 8192), (32768, 4096)]),  # runs 1-2 (6144..18432) and 5 (30720..36864)
    ([3], 2048, []),  # 6144..8192: no whole page
])
def test_only_whole_pages_of_runs_of_blocks_are_released(block_ids, block_bytes, expected) -> None:
    assert page_ranges(block_ids, block_bytes) == expected


def test_thresholds_leave_the_plan_s_worst_case_out_of_pressure() -> None:
    """In a small cgroup the plan's worst case leaves less than 2 x low of what was available: low is half of what
    it leaves (a server alone in a 920 MiB cgroup put itself under pressure by growing as planned, QA-S)."""
    assert PressureThresholds.for_memory(24 * GIB, 10 * GIB) == PressureThresholds.for_memory(24 * GIB)
    assert PressureThresholds.for_memory(920 * MIB, 300 * MIB) == PressureThresholds(150 * MIB, 300 * MIB)
    assert PressureThresholds.for_memory(920 * MIB, 20 * MIB).low_bytes == pressure.PRESSURE_FLOOR_BYTES
    plan = SimpleNamespace(request=SimpleNamespace(available=AvailableMemory(900 * MIB, "cgroup", "test",
                                                                             total_bytes=920 * MIB)),
                           total_bytes=800 * MIB)
    assert pressure.memory_pressure_for("cpu", plan).thresholds == PressureThresholds(50 * MIB, 100 * MIB)


def test_a_server_that_runs_nothing_and_has_nothing_to_give_back_relents_at_low(caplog) -> None:
    """Between low and high with nothing running and no free block left to release, waiting for high may never
    end (alone in a small cgroup the server's own steady memory keeps the headroom under it): admitting again."""
    caplog.set_level(logging.WARNING, logger="pagedserve.memory.pressure")
    nothing = SimpleNamespace(release_free_blocks=lambda: ([], []), block_size=16)
    scheduler = SimpleNamespace(hold_waiting=False, running=["a request"])
    release = lambda ids, block_size, window_ids: 0  # noqa: E731
    source = Source(50 * MIB)
    monitor = source.monitor()  # low 100 MiB, high 200 MiB
    pressure.give_way(monitor, scheduler, nothing, release)
    assert scheduler.hold_waiting and monitor.is_active
    source.num_bytes, source.now = 150 * MIB, 1.0  # over low, under high: a running request keeps it held
    pressure.give_way(monitor, scheduler, nothing, release)
    assert scheduler.hold_waiting and monitor.is_active
    scheduler.running = []
    source.now = 2.0
    pressure.give_way(monitor, scheduler, nothing, release)
    assert not scheduler.hold_waiting and not monitor.is_active
    assert "nothing more to give back: admitting again" in caplog.text
    source.num_bytes, source.now = 60 * MIB, 3.0  # under low: pressure again, idle or not
    pressure.give_way(monitor, scheduler, nothing, release)
    assert scheduler.hold_waiting and monitor.is_active
    source.now = 4.0
    pressure.give_way(monitor, scheduler, nothing, release)
    assert scheduler.hold_waiting  # under low nothing relents
