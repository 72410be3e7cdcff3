"""uvicorn's HTTP protocol with a deadline for each request's head (request line and headers), and OpenAI-style
errors for requests that do not parse.

uvicorn times a connection out only between requests, and only until its next byte: a connection that never
finishes a request's head (a stalled client, or a slowloris attack sending a header byte every few seconds) is
held for ever, and enough of them take every file descriptor the process may open. nginx closes such a
connection after client_header_timeout (60 s); this does the same after --request-head-timeout-s, counted from
the connection's start and from the end of each response (a kept-alive connection's next request). Once a
request's head is in, its body and its response take as long as they take.

A request uvicorn cannot parse got its plain-text 400 "Invalid HTTP request received."; here it gets a JSON error
body as every other error, and a head still incomplete after h11's 16 KiB (a 200 KB cookie) a 431, as nginx
and h11 itself would answer it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any

import h11

from pagedserve.entrypoints.openai.errors import error_body

logger = logging.getLogger("pagedserve.server")

LINGER_S = 2.0  # how long a refused request's connection keeps reading before it closes (nginx: lingering_timeout 5 s)


def with_json_errors(protocol: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """`protocol` (uvicorn's H11Protocol or HttpToolsProtocol: both answer what they cannot parse through
    send_400_response) answering with an OpenAI-style JSON error: 431 for a head over h11's size limit, else 400."""

    class JSONProtocolErrors(protocol):  # type: ignore[misc, valid-type]
        _lingering = False
        _status_hint = 400  # h11's own status for the error it raised (431: a head over its size limit)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            conn = getattr(self, "conn", None)  # h11's connection, one per protocol; httptools has none
            if conn is not None:  # uvicorn drops h11's error before send_400_response: keep its status
                next_event = conn.next_event

                def next_event_keeping_the_status() -> Any:
                    try:
                        return next_event()
                    except h11.RemoteProtocolError as exc:
                        self._status_hint = exc.error_status_hint
                        raise

                conn.next_event = next_event_keeping_the_status

        def data_received(self, data: bytes) -> None:
            if not self._lingering:  # else the rest of a refused request: dropped until the close
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            cycle = getattr(self, "cycle", None)  # the request whose head was read, if its body is what failed
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # its app reads a disconnect and its writes are dropped (they raised
                cycle.message_event.set()  # "Cannot call write() after write_eof()" tracebacks into the log)
            if self._replied(cycle):  # the failed request's reply is out (or going): no second one
                self._linger()
                return
            status, message = self._refusal()
            body = json.dumps(error_body(message, status)).encode()
            head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
            logger.debug("%s (HTTP %d)", message, status)  # uvicorn has logged "Invalid HTTP request received."
            self.transport.write(head.encode() + body)
            self._linger()

        def _replied(self, cycle: Any) -> bool:
            """Whether the request whose bytes failed already has (part of) its reply: its body went bad after the
            app answered (h11 reads the next request's head only once a reply is done, so an earlier request's
            finished cycle says nothing of it)."""
            conn = getattr(self, "conn", None)
            if conn is not None:
                return conn.our_state in (h11.SEND_BODY, h11.DONE, h11.MUST_CLOSE)
            return cycle is not None and cycle.response_started and not cycle.response_complete

        def _refusal(self) -> tuple[int, str]:
            """431 where h11 gave up on a head over its size limit (as h11 itself classes it), else 400."""
            if self._status_hint == 431:
                limit = getattr(self.config, "h11_max_incomplete_event_size", None) or 16384
                return 431, (f"the request's head (request line and headers) is over {limit} bytes; send large "
                             "data in the body")
            return 400, "malformed HTTP request: its request line, headers or body framing do not parse"

        def _linger(self) -> None:
            """Close once the client has the reply (nginx's lingering close): closed with the rest of its request
            unread, the kernel resets the connection, which can drop the reply before the client reads it. Stop
            writing, drop what still comes, close at the client's end of data or after LINGER_S."""
            self._lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    JSONProtocolErrors.__name__ = f"{protocol.__name__}WithJSONErrors"
    return JSONProtocolErrors


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
    """uvicorn.Config's `http`: h11, with JSON errors, and the deadline where `timeout_s` > 0. Always h11, not
    uvicorn's "auto" (httptools where installed: `.[ray]` brings it with uvicorn[standard]): httptools reports no
    status for what it cannot parse, so a 200 KB header or a chunked body past the limit got a bare 400 there
    instead of 431 and 413; parsing HTTP is a negligible part of serving a model."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    protocol = with_json_errors(H11Protocol)
    return protocol if timeout_s <= 0 else with_request_head_deadline(protocol, timeout_s)
