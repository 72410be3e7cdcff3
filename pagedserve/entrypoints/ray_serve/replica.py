"""EngineReplica: one pagedserve engine and its own FastAPI app, as a Ray Serve replica.

The app is api_server.build_app's, unchanged: the ingress hands each request over as a ForwardedRequest and the
replica runs it through the app in this process over ASGI (`serve_asgi`), yielding the response start and then
its body chunks as they are sent, so streams stream, and every route, status and error body is the single
server's. The engine loads in the constructor (Ray routes to a replica only once it returns); its loop then runs
on the thread that loaded it, as in api_server.run_server. Ray's health check asks the app's own /health.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.startup import StartupTracker
from pagedserve.entrypoints.openai.api_server import ServerState, build_app, log_startup_failure, start_engine
from pagedserve.entrypoints.openai.options import ServeOptions

logger = logging.getLogger("pagedserve.ray_serve")

REPLICA_HEADER = "x-pagedserve-replica"  # on every response: the replica that served it


@dataclass
class ForwardedRequest:
    """What the ingress received, as the replica's ASGI app needs it (headers as ASGI's byte pairs)."""

    method: str
    path: str
    raw_path: bytes
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.raw_path,
                "query_string": self.query_string, "root_path": "", "headers": self.headers,
                "client": self.client, "server": ("127.0.0.1", 0), "state": {}}


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str
    refused: bool = False  # the replica could not take the request (engine dead or not ready); nothing of it ran


async def serve_asgi(app: Any, request: ForwardedRequest, replica: str) -> AsyncIterator[ResponseStart | bytes]:
    """Run one request through the ASGI app: its ResponseStart, then each non-empty body chunk. Closing the
    iterator early (the client left) tells the app the client disconnected, and the app aborts the request."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    pending_body = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> dict:
        if pending_body:
            return pending_body.pop()
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.put_nowait(message)

    def finished(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("request %s %s failed in the app", request.method, request.path, exc_info=task.exception())
        messages.put_nowait(None)

    task = asyncio.create_task(app(request.scope(), receive, send))
    task.add_done_callback(finished)
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), replica.encode())]
                yield ResponseStart(message["status"], headers, replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()


class EngineReplica:
    """A Ray Serve deployment class (app.py applies serve.deployment with the replica count and options)."""

    async def __init__(self, engine_args: EngineArgs, options: ServeOptions) -> None:
        _log_to_stderr()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.state = ServerState(StartupTracker())
        self.app = build_app(self.state, options)
        loader = threading.Thread(target=self._load_and_run, args=(engine_args, options), name="pagedserve-engine",
                                  daemon=True)
        loader.start()
        while self.state.serving is None:  # Ray sends no request before the constructor returns
            snapshot = self.state.startup.snapshot()
            if snapshot["status"] == "error":
                raise RuntimeError(f"replica {self.replica}: start-up failed: {snapshot.get('error')}")
            await asyncio.sleep(0.1)
        logger.info("replica %s serving %s", self.replica, self.state.served_model_names[0])

    def _load_and_run(self, engine_args: EngineArgs, options: ServeOptions) -> None:
        try:
            start_engine(self.state, engine_args, options)
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it; Ray retries the replica
            log_startup_failure(exc, self.state.startup.phase)
            self.state.startup.fail(f"{type(exc).__name__}: {exc}")
            return
        self.state.engine.run_in_this_thread()  # until shutdown or death (then check_health fails)

    async def handle_http(self, request: ForwardedRequest, routing_key: str | None = None,
                          avoid: tuple[str, ...] = ()) -> AsyncIterator[ResponseStart | bytes]:
        """One HTTP request. routing_key and avoid are the router's (PrefixAffinityRouter reads them here)."""
        engine = self.state.engine
        refused = engine is None or engine.is_dead  # the app answers 503; the ingress may ask another replica
        async for item in serve_asgi(self.app, request, self.replica):
            if isinstance(item, ResponseStart):
                item.refused = refused
            yield item

    async def check_health(self) -> None:
        """Ray Serve's health check: the app's own /health must answer 200 (else Ray replaces this replica)."""
        status, body = await self._get("/health")
        if status != 200:
            raise RuntimeError(f"replica {self.replica}: /health answered {status}: {body.decode(errors='replace')}")

    def record_routing_stats(self) -> dict:
        """What the router sees of this replica (every few seconds)."""
        engine = self.state.engine
        return {"healthy": engine is not None and not engine.is_dead,
                "num_pending": engine.num_pending if engine is not None else 0}

    async def _get(self, path: str) -> tuple[int, bytes]:
        status, chunks = 500, []
        async for item in serve_asgi(self.app, ForwardedRequest("GET", path, path.encode()), self.replica):
            if isinstance(item, ResponseStart):
                status = item.status
            else:
                chunks.append(item)
        return status, b"".join(chunks)

    def __del__(self) -> None:
        engine = getattr(self, "state", None) and self.state.engine
        if engine:
            engine.shutdown()


def _log_to_stderr() -> None:
    """pagedserve's log lines (start-up phases with durations) on the replica's stderr, which Ray shows."""
    package_logger = logging.getLogger("pagedserve")
    if not package_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)
        package_logger.propagate = False
