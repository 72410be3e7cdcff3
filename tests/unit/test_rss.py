"""Resident memory against the plan (memory/rss.py) with a fake RSS source, clock and trim."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from pagedserve.memory import rss
from pagedserve.memory.plan import MIB, ModelShape, PlanRequest, make_plan
from pagedserve.memory.probe import AvailableMemory

SHAPE = ModelShape(num_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_kv_heads=2,
                   head_dim=16, vocab_size=100, weight_bytes=100 * MIB)
PLAN = make_plan(SHAPE, PlanRequest(dtype_bytes=4, kv_dtype_bytes=4, max_model_len=64, max_num_seqs=4,
                                    max_num_batched_tokens=32, block_size=16, runtime_overhead_bytes=50 * MIB,
                                    available=AvailableMemory(8 << 30, "MemAvailable", "test")))


class Fake:
    def __init__(self, rss_bytes: int) -> None:
        self.rss_bytes, self.now, self.trims, self.reads = rss_bytes, 0.0, 0, 0

    def read(self) -> int:
        self.reads += 1
        return self.rss_bytes

    def trim(self) -> None:
        self.trims += 1

    def memory(self, plan=PLAN, engines=None) -> rss.ResidentMemory:
        engines = weakref.WeakSet() if engines is None else engines  # not the engines other tests left alive
        return rss.ResidentMemory(plan, read_rss=self.read, trim=self.trim, clock=lambda: self.now, engines=engines)


def test_expected_figure_is_steady_plus_written_blocks_plus_one_step() -> None:
    memory = Fake(0).memory()
    assert memory.expected_bytes(10) == PLAN.steady_bytes + 10 * PLAN.block_bytes + PLAN.activation_bytes
    assert PLAN.block_bytes == 16 * 2 * 2 * 2 * 16 * 4


def test_trims_after_large_steps_at_once_when_idle_and_at_most_every_interval_when_busy() -> None:
    fake = Fake(PLAN.steady_bytes)
    memory = fake.memory()
    memory.after_step(num_tokens=8, kv_blocks_written=1, is_idle=False)
    assert fake.trims == 0  # busy with small steps: nothing large to hand back
    memory.after_step(num_tokens=rss.LARGE_STEP_TOKENS, kv_blocks_written=1, is_idle=False)
    assert fake.trims == 1
    fake.now += 1.0
    memory.after_step(num_tokens=1000, kv_blocks_written=1, is_idle=False)
    assert fake.trims == 1  # busy: not again within TRIM_INTERVAL_S
    memory.after_step(num_tokens=1, kv_blocks_written=1, is_idle=True)
    assert fake.trims == 2  # idle after a large step: at once
    memory.after_step(num_tokens=1, kv_blocks_written=1, is_idle=True)
    assert fake.trims == 2  # nothing large since
    fake.now += rss.TRIM_INTERVAL_S
    memory.after_step(num_tokens=300, kv_blocks_written=1, is_idle=False)
    assert fake.trims == 3
    # Going idle after small steps only: trimmed where the last trim is an interval old (a soak's load ended with
    # its large steps trimmed while busy, and 20-30 MiB of freed heap stayed resident at rest)
    fake.now += 1.0
    memory.after_step(num_tokens=1, kv_blocks_written=1, is_idle=True)
    assert fake.trims == 3  # a trim a second ago: one-at-a-time requests do not trim each
    fake.now += rss.TRIM_INTERVAL_S
    memory.after_step(num_tokens=1, kv_blocks_written=1, is_idle=False)
    memory.after_step(num_tokens=1, kv_blocks_written=1, is_idle=True)
    assert fake.trims == 4


def test_a_large_free_outside_the_step_trims_like_a_large_step() -> None:
    """A compiled grammar freed at its request's end (QA-G: 537 MB after a 100,000-value choice) is trimmed on
    going idle even when the last trim is recent; small frees are not."""
    fake = Fake(PLAN.steady_bytes)
    memory = fake.memory()
    memory.after_step(num_tokens=rss.LARGE_STEP_TOKENS, kv_blocks_written=1, is_idle=True)
    assert fake.trims == 1
    fake.now += 1.0
    memory.after_step(num_tokens=8, kv_blocks_written=1, is_idle=True, freed_bytes=rss.LARGE_FREE_BYTES - 1)
    assert fake.trims == 1  # within the interval, a small free: no trim
    memory.after_step(num_tokens=8, kv_blocks_written=1, is_idle=True, freed_bytes=rss.LARGE_FREE_BYTES)
    assert fake.trims == 2


def test_rss_is_read_at_most_every_interval_and_after_trims() -> None:
    fake = Fake(PLAN.steady_bytes)
    memory = fake.memory()
    for _ in range(5):
        memory.after_step(num_tokens=1, kv_blocks_written=2, is_idle=False)
    assert fake.reads == 1 and memory.last.kv_blocks_written == 2
    fake.now += rss.MEASURE_INTERVAL_S
    memory.after_step(num_tokens=1, kv_blocks_written=3, is_idle=False)
    assert fake.reads == 2 and memory.last.expected_bytes == memory.expected_bytes(3)
    memory.after_step(num_tokens=500, kv_blocks_written=3, is_idle=False)
    assert fake.reads == 3 and fake.trims == 1  # measured right after the trim
    memory.after_step(num_tokens=500, kv_blocks_written=3, is_idle=False)
    assert fake.reads == 3 and fake.trims == 1  # within both intervals: neither


def test_the_step_before_idle_is_always_read() -> None:
    """A burst that ends within the interval still leaves /health a current reading (the engine then stops
    stepping, so a later reading would never come)."""
    fake = Fake(PLAN.steady_bytes)
    memory = fake.memory()
    memory.after_step(num_tokens=1, kv_blocks_written=0, is_idle=False)
    memory.after_step(num_tokens=1, kv_blocks_written=7, is_idle=False)
    assert memory.last.kv_blocks_written == 0  # within the interval: not read
    memory.after_step(num_tokens=1, kv_blocks_written=9, is_idle=True)
    assert fake.reads == 2 and memory.last.kv_blocks_written == 9


def test_warns_once_per_excursion_above_the_tolerance(caplog: pytest.LogCaptureFixture) -> None:
    expected = PLAN.steady_bytes + PLAN.activation_bytes  # no KV block written
    fake = Fake(int(expected * 1.05))
    memory = fake.memory()
    caplog.set_level(logging.WARNING, logger="pagedserve.memory.rss")
    assert memory.measure(0).over_plan == pytest.approx(0.05, abs=1e-6)
    assert not caplog.records  # within 10 %
    fake.rss_bytes = int(expected * 1.2)
    memory.measure(0)
    memory.measure(0)
    assert len(caplog.records) == 1 and "20 % above the plan's" in caplog.records[0].getMessage()
    fake.rss_bytes = expected
    memory.measure(0)
    fake.rss_bytes = int(expected * 1.3)
    memory.measure(0)
    assert len(caplog.records) == 2
    assert memory.last.to_dict()["over_plan"] == pytest.approx(0.3, abs=1e-3)


def test_other_engines_in_the_process_count_their_weights_and_kv_once_overhead_and_activations_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """RSS is the process's: a second engine's weights, bookkeeping and KV blocks written (at its last reading)
    add to the expected figure, the runtime and one step's activations do not; gone, it no longer counts."""
    small = make_plan(SHAPE, PlanRequest(dtype_bytes=4, kv_dtype_bytes=4, max_model_len=64, max_num_seqs=2,
                                         max_num_batched_tokens=16, block_size=16, runtime_overhead_bytes=50 * MIB,
                                         available=AvailableMemory(8 << 30, "MemAvailable", "test")))
    engines = weakref.WeakSet()
    fake = Fake(0)
    first, second = fake.memory(engines=engines), fake.memory(small, engines)
    second.measure(3)
    second_held = small.weight_bytes + small.kv_bookkeeping_bytes + 3 * small.block_bytes
    expected = (PLAN.steady_bytes + 10 * PLAN.block_bytes + PLAN.activation_bytes + second_held
                + max(0, small.activation_bytes - PLAN.activation_bytes))
    assert first.expected_bytes(10) == expected
    caplog.set_level(logging.WARNING, logger="pagedserve.memory.rss")
    fake.rss_bytes = int(expected * 1.05)  # both engines' weights resident: within the process's figure
    assert first.measure(10).over_plan == pytest.approx(0.05, abs=1e-6)
    fake.rss_bytes = int(expected * 1.5)
    first.measure(10)
    assert "1 other engine(s) in this process" in caplog.records[-1].getMessage()
    del second
    gc.collect()
    assert first.expected_bytes(10) == PLAN.steady_bytes + 10 * PLAN.block_bytes + PLAN.activation_bytes


def test_glibc_trim_is_found_and_runs() -> None:
    trim = rss.libc_malloc_trim()
    assert trim is not None  # glibc (the dev box, the CI images); musl would give None
    assert trim() in (0, 1)
