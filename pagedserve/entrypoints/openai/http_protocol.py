"""A deadline for each request's head (request line and headers) on uvicorn's HTTP protocol.

uvicorn times a connection out only between requests, and only until its next byte: a connection that never
finishes a request's head (a stalled client, or a slowloris attack sending a header byte every few seconds) is
held for ever, and enough of them take every file descriptor the process may open. nginx closes such a
connection after client_header_timeout (60 s); this does the same after --request-head-timeout-s, counted from
the connection's start and from the end of each response (a kept-alive connection's next request). Once a
request's head is in, its body and its response take as long as they take.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("pagedserve.server")


def with_request_head_deadline(protocol: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """`protocol` (uvicorn's H11Protocol or HttpToolsProtocol: both keep the request in flight in `cycle`, with
    `response_complete`) closing a connection whose request head has not arrived `timeout_s` after the connection
    opened or its last response ended."""

    class RequestHeadDeadline(protocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._cancel_head_deadline()
            self._head_timer = self.loop.call_later(timeout_s, self._head_deadline_passed)

        def _cancel_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_deadline_passed(self) -> None:
            self._head_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:  # a request's head came: it is being served
                return
            if not self.transport.is_closing():
                logger.debug("closed a connection that sent no complete request head within %g s", timeout_s)
                self.transport.close()

    RequestHeadDeadline.__name__ = f"{protocol.__name__}WithHeadDeadline"
    return RequestHeadDeadline


def http_protocol(timeout_s: float) -> Any:
    """uvicorn.Config's `http`: uvicorn's own choice (httptools where installed, else h11), with the deadline
    where `timeout_s` > 0."""
    if timeout_s <= 0:
        return "auto"
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return with_request_head_deadline(AutoHTTPProtocol, timeout_s)
