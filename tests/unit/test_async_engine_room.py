"""AsyncEngine's room: what check_room lets in is held for it until generate() registers it, so responses that
check at once cannot all pass and then meet a full queue after their 200 (streams got an error event)."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import pytest

from pagedserve.engine import async_engine
from pagedserve.engine.async_engine import AsyncEngine, QueueFullError
from pagedserve.sampling_params import SamplingParams


def _engine(max_num_seqs: int = 1, max_waiting_requests: int = 1) -> AsyncEngine:
    """An AsyncEngine whose loop never runs: requests stay registered (queued or running) for the whole test."""
    scheduler = SimpleNamespace(max_num_seqs=max_num_seqs, max_waiting_requests=max_waiting_requests)
    return AsyncEngine(SimpleNamespace(config=SimpleNamespace(scheduler=scheduler)), start_thread=False)


async def _register(engine: AsyncEngine, request_id: str, reservation=None):
    """Start a request's stream until it has registered (its first output never comes here)."""
    stream = engine.generate(request_id, "x", SamplingParams(max_tokens=1), reservation=reservation)
    task = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    if task.done():
        task.result()  # a QueueFullError it raised
    return stream, task


def test_room_checked_at_once_is_held_until_the_requests_register():
    async def run():
        engine = _engine()  # room for 2
        first, second = engine.check_room(1), engine.check_room(1)
        with pytest.raises(QueueFullError):  # both passed responses hold the room before they register
            engine.check_room(1)
        with pytest.raises(QueueFullError):  # nor may a request without a reservation take it
            await _register(engine, "other")
        started = [await _register(engine, "a", first), await _register(engine, "b", second)]
        assert engine.num_pending == 2
        with pytest.raises(QueueFullError):
            engine.check_room(1)
        for _, task in started:
            task.cancel()
        await asyncio.sleep(0)
    asyncio.run(run())


def test_room_a_response_never_takes_comes_back():
    engine = _engine()
    held = engine.check_room(2)
    with pytest.raises(QueueFullError):
        engine.check_room(1)
    del held  # the response failed before starting its requests: its room is free again at once
    gc.collect()
    engine.check_room(2)


def test_room_held_past_its_time_comes_back(monkeypatch):
    engine = _engine()
    monkeypatch.setattr(async_engine, "RESERVATION_S", 0.0)  # kept alive, but expired
    held = engine.check_room(2)
    assert engine.check_room(2) is not held
