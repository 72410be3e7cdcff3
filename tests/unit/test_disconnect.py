"""A non-streamed request's client going away: the disconnect is awaited (as vLLM's with_cancellation), so the
request is cancelled and its streams closed when it comes (it was polled every 0.5 s)."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.serving import consume_unless_disconnected


class Client:
    """A Starlette request whose body was read: its next message is the disconnect, once `gone` is set."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


class Streams:
    closed = False

    async def aclose(self) -> None:
        self.closed = True


def test_the_disconnect_cancels_the_request_and_closes_its_streams():
    async def run() -> tuple[bool, bool]:
        client, streams, cancelled = Client(), Streams(), asyncio.Event()

        async def consume() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        asyncio.get_running_loop().call_later(0.01, client.gone.set)
        with pytest.raises(APIError, match="client disconnected"):
            await consume_unless_disconnected(consume(), streams, client)
        return cancelled.is_set(), streams.closed

    assert asyncio.run(run()) == (True, True)


def test_an_answer_before_any_disconnect_is_returned():
    async def run() -> None:
        async def consume() -> None:
            await asyncio.sleep(0)

        streams = Streams()
        await consume_unless_disconnected(consume(), streams, Client())
        assert not streams.closed

    asyncio.run(run())
