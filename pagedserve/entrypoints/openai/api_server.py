"""The HTTP server: routes, auth and body-size guard, start-up in the background, graceful shutdown.

The port opens before the weights load: /health answers 503 with the start-up phase until the engine
is ready, then 200; it answers 503 again if the engine dies, and the process then exits non-zero.
The web page (entrypoints/web/: chat and dashboard) is served at / from the same moment, without the
API key: it carries no secret, and asks the user for the key the API wants.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.routing import Mount
from prometheus_client import CollectorRegistry

from pagedserve import __version__, envs
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.startup import PHASES, StartupTracker
from pagedserve.entrypoints.openai.errors import APIError, error_body, install_error_handlers
from pagedserve.entrypoints.openai.request_body import JSONBodyRoute
from pagedserve.entrypoints.openai.options import ServeOptions
from pagedserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                    EmbeddingRequest, RerankRequest, ResponsesRequest, ScoreRequest,
                                                    TokenizeRequest)
from pagedserve.entrypoints.openai.http_protocol import http_protocol
from pagedserve.entrypoints.openai.serving import OpenAIServing
from pagedserve.exceptions import InvalidRequestError
from pagedserve.memory.pressure import RETRY_AFTER_S, MemoryPressure, memory_pressure_for
from pagedserve.metrics import HTTP_EXCLUDED, EngineMetrics, HttpMetrics, new_registry

logger = logging.getLogger("pagedserve.server")

# Answered without the API key (vLLM's key guards /v1 only; here every other path too, /tokenize and /server_info
# included): /ping is SageMaker's health check, /version what monitoring asks (nothing private in either).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
_MAX_LOGGED_HOSTS = 8  # refused Host names logged, each once
WEB_DIR = Path(__file__).resolve().parent.parent / "web"  # index.html, *.js, *.css: no build step
WEB_ASSETS_PREFIX = "/web/"
# Seconds before the shutdown grace period ends at which the requests still open are failed with a 503, leaving
# time to send it (at most half the grace period).
_ANSWER_TIME_S = 1.0
# Bytes a second a request body must keep up on average once it has taken --request-body-timeout-s (Apache
# mod_reqtimeout's MinRate): a body trickled a byte a second, never idle for long, would otherwise hold its
# connection for as long as its Content-Length says, while the largest body (8 MiB) still has 4.7 hours at 500 B/s.
BODY_MIN_RATE = 500
BODY_TIMED_OUT = "pagedserve.body_timed_out"  # the scope key GuardMiddleware sets on a request it answered 408


@dataclass
class ServerState:
    startup: StartupTracker
    engine: AsyncEngine | None = None
    serving: OpenAIServing | None = None
    metrics: Any = None  # EngineMetrics once ready
    registry: CollectorRegistry = field(default_factory=new_registry)  # /metrics: the HTTP metrics, then the engine's
    served_model_names: list[str] = field(default_factory=list)
    memory_plan: Any = None  # memory.plan.MemoryPlan the engine was sized by (None until ready)
    memory_pressure: MemoryPressure | None = None  # set when ready on a CPU
    max_model_len: int = 0
    model_path: str = ""
    task: str = "generate"  # "embed": /v1/embeddings only; "generate": completions and chat only
    info: dict = field(default_factory=dict)  # /server_info once ready: model, dtype, kernels, memory plan
    stopping: threading.Event = field(default_factory=threading.Event)  # the shutdown grace ran out
    created: int = field(default_factory=lambda: int(time.time()))

    def ready_serving(self) -> OpenAIServing:
        """The serving layer, or a 503 that says what the server is doing."""
        if self.engine is not None and self.engine.is_dead:
            raise APIError(f"the engine stopped: {self.engine.error}", 503)
        if self.serving is None:
            snap = self.startup.snapshot()
            if snap["status"] == "error":
                raise APIError(f"start-up failed: {snap.get('error')}", 503)
            progress = f" {int(snap['progress'] * 100)}%" if snap["progress"] is not None else ""
            raise APIError(f"the server is starting ({snap['phase']}{progress}); retry shortly", 503,
                           headers={"Retry-After": "1"})
        return self.serving

    def memory_report(self) -> dict:
        """/health's memory fields once ready: how the KV pool was sized, the last RSS reading against the plan."""
        report = {}
        if self.memory_plan is not None:
            report["kv_cache"] = self.memory_plan.kv_cache_report()
        memory = self.engine.engine.resident_memory if self.engine is not None else None
        if memory is not None and memory.last is not None:
            report["memory"] = memory.last.to_dict()
        if self.memory_pressure is not None:
            self.memory_pressure.check()
            report["memory_pressure"] = self.memory_pressure.report()
        return report

    def check_memory_pressure(self) -> None:
        """A 503 with Retry-After for a new request while the box is short of memory (memory/pressure.py)."""
        if self.memory_pressure is not None and self.memory_pressure.check():
            raise APIError("the server is short of memory (memory_pressure) and admits no new requests until it "
                           "recovers; retry later", 503, code="memory_pressure",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def serving_for(self, task: str, path: str, model: str | None) -> OpenAIServing:
        """The serving layer if this model does `task` (after the model-name check), else a 400 saying why."""
        serving = self.ready_serving()
        serving.check_model(model)
        self.check_memory_pressure()
        if task == self.task:
            return serving
        if task == "embed":
            raise InvalidRequestError("this model serves text generation, not embeddings; start an embedding model "
                                      f"(e.g. --task embed) for {path}", param="model")
        raise InvalidRequestError(f"this model serves embeddings, not text generation: {path} is not available; "
                                  "use /v1/embeddings (or start a generative model for completions and chat)",
                                  param="model")


class _BodyDeadline:
    """A request's receive and send with --request-body-timeout-s on its body, as nginx's client_body_timeout.

    uvicorn times nothing once a request's head is in (http_protocol.py times the head): a body that stops short of
    its Content-Length, a chunked body without its last chunk, or one trickled a byte a second held its connection,
    and the app task reading it, for ever. Here, while the body is not all in and nothing of the response has gone
    out, a read waits at most `timeout_s` for more, and the body is due `timeout_s` + received / BODY_MIN_RATE
    seconds after the request began. A read that outwaits either gets the client a 408 with Connection: close
    (uvicorn closes the connection after it) and hands the app a disconnect, as if the client had left; what the
    app answers to that is dropped, and not counted in the HTTP metrics (as the other refusals here). The clock
    runs only inside a read: uvicorn stops reading a socket whose body the app is not taking, and then the client
    is not the one that is slow.
    """

    def __init__(self, scope: dict, receive: Any, send: Any, timeout_s: float) -> None:
        self.scope = scope
        self._receive, self._send, self.timeout_s = receive, send, timeout_s
        self.began = time.monotonic()
        self.received = 0  # body bytes so far
        self.body_done = timeout_s <= 0  # the body's last part came (or no limit): reads are the app's own
        self.response_started = False
        self.timed_out = False

    async def send(self, message: dict) -> None:
        if self.timed_out:
            return  # the app's answer to the disconnect it was handed: the client has its 408
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)

    async def receive(self) -> dict:
        if self.body_done or self.response_started:
            return await self._receive()
        due = self.began + self.timeout_s + self.received / BODY_MIN_RATE - time.monotonic()
        wait = max(0.0, min(self.timeout_s, due))
        try:
            message = await asyncio.wait_for(self._receive(), wait)
        except asyncio.TimeoutError:
            if self.response_started:  # another of the app's tasks began the response meanwhile: not ours to cut
                return await self._receive()
            # idle: a whole timeout_s without a byte (the first wait, counted from the request's start, is a
            # little shorter: no byte at all is a stall too, not a body "too slow")
            return await self._time_out(idle=wait >= self.timeout_s or self.received == 0)
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
        else:
            self.received += len(message.get("body", b""))
        return message

    async def _time_out(self, idle: bool) -> dict:
        self.timed_out = self.response_started = True
        self.scope[BODY_TIMED_OUT] = True  # HttpMetricsMiddleware leaves it out
        elapsed = time.monotonic() - self.began
        if idle:
            message = (f"the request body stalled: nothing more of it came for {self.timeout_s:g} s "
                       f"(--request-body-timeout-s), after {self.received} bytes")
        else:
            message = (f"the request body came too slowly: {self.received} bytes in {elapsed:.1f} s, under "
                       f"{BODY_MIN_RATE} bytes/s once it took longer than --request-body-timeout-s "
                       f"({self.timeout_s:g} s)")
        logger.debug("answered 408 to a request whose body stalled: %s", message)
        await _send_error(self._send, message, 408)
        return {"type": "http.disconnect"}


class GuardMiddleware:
    """API-key check (constant-time), request-body size limit and body deadline, as plain ASGI (streaming-safe)."""

    def __init__(self, app: Any, api_key: str | list[str] | None, max_body_bytes: int,
                 open_web_ui: bool = False, stopping: threading.Event | None = None,
                 host_names: frozenset[str] | None = None, body_timeout_s: float = 0.0) -> None:
        self.app = app
        self.host_names = host_names  # a loopback server's Host names (DNS rebinding); None: any
        self.refused_hosts: set[str] = set()  # logged once each (at most _MAX_LOGGED_HOSTS)
        self.stopping = stopping or threading.Event()  # set when the shutdown grace runs out
        keys = [api_key] if isinstance(api_key, str) else api_key or []
        self.expected = [f"Bearer {key}".encode() for key in keys] or None  # any of them (vLLM's --api-key k1 k2)
        self.max_body_bytes = max_body_bytes
        self.open_web_ui = open_web_ui  # the page and its assets need no key: the page asks for it
        self.body_timeout_s = body_timeout_s  # --request-body-timeout-s; 0: none

    def is_open(self, scope: dict) -> bool:
        path = route_path(scope)
        if path in OPEN_PATHS:
            return True
        return self.open_web_ui and (path == "/" or path.startswith(WEB_ASSETS_PREFIX))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = _BodyDeadline(scope, receive, send, self.body_timeout_s)
        try:
            return await self._guarded(scope, body.receive, body.send)
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                raise
            # The shutdown grace ran out and uvicorn cancels what is left (a request still reading its body): a 503
            # where nothing was sent yet, and no "Exception in ASGI application" traceback in the log.
            if not body.response_started:
                with contextlib.suppress(Exception):
                    await _send_error(send, "the server is shutting down: --shutdown-grace-s ran out before this "
                                            "request finished", 503)
            return None

    def _log_refused_host(self, name: str) -> None:
        """The operator's side of the 400: a reverse proxy on this host that forwards its clients' Host (nginx's
        proxy_set_header Host $host) has every request refused, and the clients see only the 400."""
        if name in self.refused_hosts or len(self.refused_hosts) >= _MAX_LOGGED_HOSTS:
            return
        self.refused_hosts.add(name)
        logger.warning("refused a request with Host %r (a loopback server answers localhost, 127.0.0.1 and [::1] "
                       "only, against DNS rebinding): a reverse proxy on this host that forwards its clients' Host "
                       "needs --allowed-hosts '[%s]', or has to send Host localhost", name[:100],
                       json.dumps(name[:100]))

    async def _guarded(self, scope: dict, receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or [])
        server = (scope.get("server") or ("",))[0] or ""
        loopback = server in ("127.0.0.1", "::1") or server.startswith("127.")  # a socket (not an in-process client)
        host = headers.get(b"host")  # none: no browser sent it (HTTP/1.0 health checks), so no rebinding either
        if self.host_names is not None and loopback and host and _host_name(host) not in self.host_names:
            self._log_refused_host(_host_name(host))
            return await _send_error(send, "this server answers Host localhost (or 127.0.0.1, [::1]) only: name "
                                           "another with --allowed-hosts", 400)
        if self.expected is not None and not self.is_open(scope):
            provided = headers.get(b"authorization", b"")
            scheme, _, credentials = provided.partition(b" ")
            if scheme.lower() == b"bearer":  # RFC 9110 11.1: the scheme in any case, one or more spaces after it
                provided = b"Bearer " + credentials.lstrip(b" ")
            if not any([hmac.compare_digest(provided, expected) for expected in self.expected]):  # each compared
                return await _send_error(send, "invalid or missing API key: send 'Authorization: Bearer <key>'", 401)
        length = headers.get(b"content-length")
        if b"transfer-encoding" in headers:  # it overrides Content-Length (RFC 9112 6.3), as the HTTP parser reads
            length = None  # the body: both headers together carried 20 MiB past an 8 MiB limit
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(send, f"request body of {int(length)} bytes exceeds the limit of "
                                           f"{self.max_body_bytes} bytes", 413)
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            # A chunked body says its size only as it arrives: read it here, within the limit, and hand it on
            receive = await self._read_limited(receive, send)
            if receive is None:
                return None
        await self.app(scope, receive, send)

    async def _read_limited(self, receive: Any, send: Any) -> Any:
        """A receive that replays a body of unstated length read whole (then the client's own receive, which
        tells a streaming response that the client left); None after a 413 when the body outgrew the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before it finished sending
                return _replay([message], receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await _send_error(send, f"request body of more than {self.max_body_bytes} bytes (sent without "
                                        "Content-Length) exceeds the limit", 413)
                return None
            if not message.get("more_body", False):
                return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def in_container() -> bool:
    """Whether this process runs in a Docker or Podman container (the files they create)."""
    return any(os.path.exists(path) for path in ("/.dockerenv", "/run/.containerenv"))


def _host_name(host: bytes) -> str:
    """A Host header's name, without the port and IPv6 brackets, lower-case."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return (text.rsplit(":", 1)[0] if text.count(":") == 1 else text).rstrip(".")  # "localhost." is localhost


def _replay(messages: list[dict], receive: Any) -> Any:
    """An ASGI receive that returns `messages` first, then whatever `receive` returns."""
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()
    return replayed


class RootPathMiddleware:
    """--root-path: the prefix a proxy serves us under. Requests may come with it (the proxy keeps the path) or
    without (it strips the prefix); both become the full path with scope["root_path"] set (uvicorn's form),
    which routing and the mounted page assets understand."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            path, root = scope["path"], self.root_path
            scope = {**scope, "root_path": root}
            if not (path == root or path.startswith(root + "/")):
                scope["path"] = root + path
                if scope.get("raw_path") is not None:
                    scope["raw_path"] = root.encode() + scope["raw_path"]
        await self.app(scope, receive, send)


def route_path(scope: dict) -> str:
    """The path the routes see: the request's path less the --root-path prefix (Starlette's rule)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


async def _send_error(send: Any, message: str, status: int) -> None:
    body = json.dumps(error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))  # RFC 9110: a 401 names the scheme it takes
    if status == 408:
        headers.append((b"connection", b"close"))  # RFC 9110: a 408 closes the connection (its request is unread)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_app(state: ServerState, options: ServeOptions | None = None) -> FastAPI:
    options = options or ServeOptions()
    docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} if options.disable_fastapi_docs else {}
    app = FastAPI(title="pagedserve", version=__version__, **docs)
    app.router.route_class = JSONBodyRoute  # bodies that cannot be read are refused with the reason
    install_error_handlers(app)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    if options.enable_web_ui:
        _add_web_routes(app)
    # Middleware added last runs first: the root path is stripped, then CORS answers preflights (which carry
    # no API key), then the key, body size and body deadline are checked, then what passed is counted.
    app.add_middleware(HttpMetricsMiddleware, metrics=HttpMetrics(state.registry))
    app.add_middleware(GuardMiddleware, api_key=options.api_key, max_body_bytes=options.max_request_body_bytes,
                       open_web_ui=options.enable_web_ui, stopping=state.stopping,
                       host_names=None if options.uds else options.host_names(),
                       body_timeout_s=options.request_body_timeout_s)
    if options.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    cors = options.cors()
    if cors is not None:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, **cors)
    root_path = options.root_path.rstrip("/")
    if root_path:
        app.add_middleware(RootPathMiddleware, root_path=root_path)
    app.state.server_state = state
    return app


class HttpMetricsMiddleware:
    """vLLM's HTTP metrics (metrics.HttpMetrics). Innermost, as vLLM's instrumentator: the router has put the route
    that answered into the scope by the time the response is done, and requests turned away by the key, size or
    body-deadline checks are not counted. A stream pays one comparison per chunk."""

    def __init__(self, app: Any, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, path = time.perf_counter(), route_path(scope)  # before a mount rewrites the scope
        response: dict = {"status": 500, "headers": ()}  # an exception that escapes is a 500, as vLLM's counts it

        async def send_start_seen(message: dict) -> None:
            if message["type"] == "http.response.start":
                response.update(message)
            await send(message)

        try:
            await self.app(scope, receive, send_start_seen)
        finally:
            handler = _handler(scope, path)  # none matched: the path decides the exclusion, and counts as "none"
            timed_out = scope.get(BODY_TIMED_OUT)  # answered 408 outside: the app's own answer went nowhere
            if not timed_out and not any(excluded in (path if handler == "none" else handler)
                                         for excluded in HTTP_EXCLUDED):
                self.metrics.observe(scope["method"], handler, response["status"], time.perf_counter() - started,
                                     _content_length(scope["headers"]), _content_length(response["headers"]))


def _handler(scope: dict, path: str) -> str:
    """The route that answered `path` (as the routes saw it: a mount rewrites the scope), as the instrumentator
    names it: its path template, a mount's path for what the mount serves (the page's assets: "/web"), else
    "none"."""
    route = scope.get("route")
    if route is not None:
        return route.path
    for mount in getattr(scope.get("app"), "routes", ()):
        if isinstance(mount, Mount) and path.startswith(mount.path + "/"):
            return mount.path
    return "none"


def _content_length(headers: Any) -> int:
    """A Content-Length header's value; 0 without one (a stream), as the instrumentator reads it."""
    value = dict(headers).get(b"content-length", b"0")
    return int(value) if value.isdigit() else 0


class RequestIdMiddleware:
    """--enable-request-id-headers: every response carries X-Request-Id, the client's or a new one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"x-request-id")
        request_id = given if given and len(given) <= 256 and given.isascii() else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    # HEAD too: load balancers and uptime checkers probe with it (it was a 405)
    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/ping", methods=["GET", "HEAD", "POST"])  # SageMaker's health check (vLLM answers it too)
    async def health() -> JSONResponse:
        if state.engine is not None and state.engine.is_dead:
            return JSONResponse({"status": "error", "phase": "dead", "error": str(state.engine.error)}, 503)
        snap = state.startup.snapshot()
        snap.update(state.memory_report())
        if snap["status"] == "ready" and state.serving is None:
            # The engine is ready; the serving layer is still being set up (metrics, its tokenizer pool warmed):
            # still warming up, so a 503 never says "ready".
            snap.update(status="starting", phase="warming_up")
        return JSONResponse(snap, status_code=200 if snap["status"] == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if state.metrics is not None and state.engine is not None:
            state.metrics.observe_engine_state(state.engine.engine)
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/server_info")
    async def server_info() -> dict:
        state.ready_serving()
        return {"version": __version__, **state.info}

    def card(name: str) -> dict:
        # vLLM's model card, its one permission entry included (clients written for it read the list)
        permission = {"id": f"modelperm-{name}", "object": "model_permission", "created": state.created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"id": name, "object": "model", "created": state.created, "owned_by": "pagedserve",
                "root": state.model_path, "parent": None, "max_model_len": state.max_model_len,
                "permission": [permission]}

    @app.get("/v1/models")
    async def models() -> dict:
        state.ready_serving()
        return {"object": "list", "data": [card(name) for name in state.served_model_names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        """OpenAI's retrieve (`client.models.retrieve`); names may hold '/' (e.g. Qwen/Qwen2.5-0.5B)."""
        state.ready_serving().check_model(model)
        return card(model)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await state.serving_for("generate", "/v1/completions", body.model).create_completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        serving = state.serving_for("generate", "/v1/chat/completions", body.model)
        return await serving.create_chat_completion(body, raw)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Any:
        from pagedserve.entrypoints.openai.serving_responses import ResponsesServing

        return await ResponsesServing(state.serving_for("generate", "/v1/responses", body.model)).create(body, raw)

    # OpenAI's calls on a stored response (retrieve, delete, cancel, list its input items): nothing is stored here
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    @app.api_route("/v1/responses/{response_id}/cancel", methods=["POST"])
    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_response(response_id: str) -> Any:
        raise APIError(f"no response {response_id!r}: responses are not stored here (each reply is returned "
                       "once; send the conversation in the next request's input)", 404, param="response_id")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return await state.ready_serving().tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await state.ready_serving().detokenize(body)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Any:
        return await state.serving_for("embed", "/v1/embeddings", body.model).create_embedding(body, raw)

    async def score(body: ScoreRequest, raw: Request) -> Any:
        path = app_path(raw.url.path, raw.scope.get("root_path", ""))
        return await state.serving_for("embed", path, body.model).create_score(body, raw)

    async def rerank(body: RerankRequest, raw: Request) -> Any:
        path = app_path(raw.url.path, raw.scope.get("root_path", ""))
        return await state.serving_for("embed", path, body.model).create_rerank(body, raw)

    for path in ("/score", "/v1/score"):  # vLLM's
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):  # vLLM's (Jina's and Cohere's shape)
        app.post(path)(rerank)

    routes = {"messages": (ChatCompletionRequest, chat), "prompt": (CompletionRequest, completions),
              "input": (EmbeddingRequest, embeddings)}

    @app.post("/invocations")
    async def invocations(raw: Request) -> Any:
        """SageMaker's one endpoint (as vLLM's): `messages` is a chat request, `prompt` a completion, `input` an
        embedding request."""
        if raw.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            # as the other routes: text/plain and form bodies are what any web page may post without a preflight
            raise InvalidRequestError("the request body must be a JSON object, sent with Content-Type: "
                                      "application/json (curl: add -H 'Content-Type: application/json')")
        body = await raw.json()  # a JSONBodyRequest (request_body.py); a syntax error is errors.py's to word
        kind = next((key for key in routes if isinstance(body, dict) and key in body), None)
        if kind is None:
            raise InvalidRequestError("/invocations takes a chat (messages), completion (prompt) or embedding "
                                      "(input) request body")
        request_class, handler = routes[kind]
        try:
            request = request_class.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        return await handler(request, raw)


def _add_web_routes(app: FastAPI) -> None:
    """The page at / and its assets at /web/. Every URL in them is relative; the <base> names the prefix a
    proxy serves us under (--root-path), so the page works at /prefix and /prefix/ alike."""
    page = (WEB_DIR / "index.html").read_text(encoding="utf-8")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index(raw: Request) -> HTMLResponse:
        root = raw.scope.get("root_path", "").rstrip("/")
        body = page.replace('<base href="./">', f'<base href="{html.escape(root, quote=True)}/">') if root else page
        return HTMLResponse(body, headers={"Cache-Control": "no-cache", **WEB_PAGE_HEADERS})

    app.mount(WEB_ASSETS_PREFIX.rstrip("/"), _WebAssets(directory=WEB_DIR), name="web")


# The page runs only its own files (no inline script, no other origin), cannot be framed (clickjacking), and its
# files are not sniffed into another type.
WEB_PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                               "base-uri 'self'; frame-ancestors 'none'",
                    "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY"}


class _WebAssets(StaticFiles):
    """The page's files, revalidated on every load (an upgraded server's page ran the old scripts from the
    browser's cache), with the page's headers; index.html only at / (here its relative URLs missed)."""

    async def get_response(self, path: str, scope: Any) -> Any:
        if path in ("", ".", "index.html"):
            return JSONResponse(error_body("the web page is at /", 404), status_code=404)
        response = await super().get_response(path, scope)
        response.headers.update({"Cache-Control": "no-cache", **WEB_PAGE_HEADERS})
        return response


def describe_server(llm_engine: Any) -> dict:
    """What the dashboard shows about the server: model, dtype, kernels in use, the memory plan's summary."""
    config = llm_engine.config
    plan = config.memory_plan
    info = {
        "model": {"name": config.model.served_model_name, "path": config.model.model,
                  "architecture": config.model.architecture, "dtype": config.model.dtype,
                  "quantization": config.model.quantization, "task": config.model.task,
                  "max_model_len": config.model.max_model_len},
        "device": config.device.device, "num_threads": config.device.num_threads,
        # num_blocks: the blocks requests can hold, as /health and `plan` count them (the pool also has the null block)
        "cache": {"block_size": config.cache.block_size, "num_blocks": config.cache.num_blocks - 1,
                  "num_window_blocks": config.cache.num_window_blocks, "sliding_window": config.cache.sliding_window,
                  "kv_cache_dtype": config.cache.kv_cache_dtype,
                  "enable_prefix_caching": config.cache.enable_prefix_caching},
        "scheduler": {"max_num_seqs": config.scheduler.max_num_seqs,
                      "max_num_batched_tokens": config.scheduler.max_num_batched_tokens},
        "kernels": llm_engine.kernel_report(),
    }
    if plan is not None:
        info["memory_plan"] = {"summary": plan.summary(), "weight_bytes": plan.weight_bytes,
                               "kv_pool_bytes": plan.kv_pool_bytes, "activation_bytes": plan.activation_bytes,
                               "overhead_bytes": plan.overhead_bytes, "total_bytes": plan.total_bytes,
                               "budget_bytes": plan.budget_bytes, "steady_bytes": plan.steady_bytes,
                               "kv_cache": plan.kv_cache_report()}
    return info


# ---- process lifecycle -------------------------------------------------------------------------------
def start_engine(state: ServerState, args: EngineArgs, options: ServeOptions | None = None) -> None:
    """Build the engine (phases tracked on `state.startup`); raises on failure."""
    from pagedserve.engine.llm_engine import LLMEngine

    options = options or ServeOptions()
    llm_engine = LLMEngine.from_engine_args(args, state.startup)
    if options.chat_template is not None:  # --chat-template replaces the model's, for every use of it
        from pagedserve.chat_template import load_chat_template

        llm_engine.tokenizer.chat_template = load_chat_template(options.chat_template)
    else:
        from pagedserve.chat_template import template_problem

        problem = template_problem(getattr(llm_engine.tokenizer, "chat_template", None))
        if problem:
            logger.warning("the model's %s: chat requests will get a 400; serve with --chat-template FILE (a working "
                           "template) to chat with it", problem)
    config = llm_engine.config
    name = config.model.served_model_name
    metrics = EngineMetrics.for_engine(llm_engine, state.registry)  # the gauges have their start-up reading already
    if not options.disable_log_stats:
        _start_stats_log(metrics.stats_log, envs.log_stats_interval_s())
    llm_engine.observe_grammar_compiles(metrics.observe_grammar_compile)
    # The engine loop runs on this thread, which warmed the model up (AsyncEngine.run_in_this_thread).
    state.engine = AsyncEngine(llm_engine, observer=metrics.observe_step, start_thread=False)
    state.metrics = metrics
    state.served_model_names = [name, *config.model.served_model_aliases]
    state.memory_plan = config.memory_plan
    state.memory_pressure = memory_pressure_for(config.device.device, config.memory_plan, args.memory_pressure_meminfo)
    llm_engine.give_way_under(state.memory_pressure)
    state.max_model_len = config.model.max_model_len
    state.model_path = config.model.model
    state.task = config.model.task
    state.info = describe_server(llm_engine)
    if state.task == "embed":
        from pagedserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding

        state.serving = OpenAIServingEmbedding(state.engine, state.served_model_names, state.max_model_len, options)
    else:
        state.serving = OpenAIServing(state.engine, state.served_model_names, state.max_model_len, options)


def _start_stats_log(stats_log: Any, interval_s: float) -> None:
    """vLLM's periodic stats line (metrics.StatsLog), from a daemon thread, every `interval_s` while there is work."""
    def run() -> None:
        while True:
            time.sleep(interval_s)
            line = stats_log.line(time.monotonic())
            if line:
                logger.info("%s", line)

    threading.Thread(target=run, name="pagedserve-stats-log", daemon=True).start()


def _socket_of(connection: Any) -> Any:
    """The socket under a uvicorn connection (None if its transport no longer says)."""
    transport = getattr(connection, "transport", None)
    try:
        return transport.get_extra_info("socket") if transport is not None else None
    except AttributeError:  # a TLS transport already closed twice
        return None


def _make_uvicorn_server(config: Any, on_grace_expired: Callable[[bool], None] = lambda stopped_early: None) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        stop_now = False  # a second signal: the grace period ends at once

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            """As uvicorn's, minus re-raising the signal afterwards: SIGTERM/SIGINT end in a graceful
            shutdown (in-flight requests finish within the grace period) and exit code 0."""
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            name = signal.Signals(sig).name
            if not self.should_exit:  # the first signal: the log says the stop began (QA-AF: it said nothing)
                logger.info("%s: stopping; requests in flight get up to %g s to finish (--shutdown-grace-s)",
                            name, config.timeout_graceful_shutdown)
            elif not self.stop_now:  # the second: the open requests end now, each with its 503 (uvicorn's forced
                self.stop_now = True  # exit cut streams without an error event and logged CancelledErrors)
                logger.info("%s again: requests still open get a 503 now (another signal cuts them off)", name)
                return
            else:  # the third: uvicorn's forced exit
                self.force_exit = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            # The open connections' sockets, taken before uvicorn asks each connection to close: a TLS transport
            # closed a second time lets go of its socket.
            self.open_sockets = [sock for sock in map(_socket_of, list(self.server_state.connections)) if sock]
            await super().shutdown(sockets)

        async def _wait_tasks_to_complete(self) -> None:
            """As uvicorn's (which cancels what is left when the grace period ends: a plain-text 500, or a
            stream cut short), but:
            - shortly before the grace period ends, `on_grace_expired` fails the requests still open, so each
              gets a 503 with an error body (a stream: an error event and [DONE]) while there is time to send it;
              a second signal does that at once, and cuts off what has not answered _ANSWER_TIME_S later;
            - once no request is running the connections left open are shut, not waited for: closing a TLS
              connection waits for the client's close_notify (asyncio allows 30 s), and a client idling on a
              keep-alive connection never sends one, so an https server took the whole grace period to stop."""
            grace = self.config.timeout_graceful_shutdown
            fail_at = None if grace is None else time.monotonic() + grace - min(_ANSWER_TIME_S, grace / 2)
            answer_by = None  # after a second signal: the failed requests' time to send their 503s
            while self.server_state.tasks and not self.force_exit:
                now = time.monotonic()
                if self.stop_now and answer_by is None:
                    answer_by = now + _ANSWER_TIME_S
                    if fail_at is not None or grace is None:  # (not failed already by the grace period)
                        fail_at = None
                        on_grace_expired(True)
                if fail_at is not None and now >= fail_at:
                    fail_at = None
                    on_grace_expired(False)
                if answer_by is not None and now >= answer_by:
                    self.force_exit = True  # what has not answered by now is cut off
                    break
                await asyncio.sleep(0.05)
            for sock in getattr(self, "open_sockets", ()):
                with contextlib.suppress(OSError):  # on a duplicate: uvloop's transport sockets refuse shutdown()
                    with socket.fromfd(sock.fileno(), sock.family, sock.type) as duplicate:
                        duplicate.shutdown(socket.SHUT_RDWR)
            await super()._wait_tasks_to_complete()

    return Server(config)


def log_startup_failure(exc: BaseException, phase: str | None = None) -> None:
    """The type and message; the traceback too, unless the message is the whole story: a refusal whose table
    and fix were logged already, or a ValueError about the settings or the model found before any weight is
    read (`phase` up to planning: an unknown model, a flag the model cannot take). Those log their traceback
    at debug level."""
    from pagedserve.cli.common import USER_FACING_ERRORS

    before_loading = phase in PHASES[:PHASES.index("loading_weights")]
    if isinstance(exc, USER_FACING_ERRORS) or (before_loading and isinstance(exc, ValueError)):
        logger.error("start-up failed: %s: %s", type(exc).__name__, exc)
        logger.debug("where it failed:", exc_info=exc)
    else:
        logger.error("start-up failed: %s: %s", type(exc).__name__, exc, exc_info=exc)


def app_path(path: str, root_path: str) -> str:
    """A request's path without the --root-path prefix, whether the proxy kept it or stripped it."""
    root = root_path.rstrip("/")
    return path[len(root):] if root and path.startswith(root + "/") else path


class _SkipPaths(logging.Filter):
    """uvicorn's access-log records of the paths --disable-access-log-for-endpoints names are dropped, with or
    without the --root-path prefix (a proxy may keep it or strip it)."""

    def __init__(self, paths: set[str], root_path: str = "") -> None:
        super().__init__()
        self.paths = paths
        self.root_path = root_path

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]).split("?", 1)[0] if len(args) > 2 else ""  # (client, method, path, version, status)
        return app_path(path, self.root_path) not in self.paths


def _quiet_access_log(endpoints: str | None, root_path: str = "") -> None:
    paths = {p.strip() for p in (endpoints or "").split(",") if p.strip()}
    if paths:
        logging.getLogger("uvicorn.access").addFilter(_SkipPaths(paths, root_path))


def _socket_mode_from_umask(path: str, server: Any, wait_s: float = 10.0) -> None:
    """uvicorn makes the --uds socket 0666 whatever the umask: once it listens, give it the mode the umask allows
    (a server started under umask 077 then answers only its own user)."""
    deadline = time.monotonic() + wait_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~umask)


def _hold_startup(path: str | None) -> None:
    """Testing only (the web page's start-up view): wait, in phase "starting", while `path` exists."""
    while path and os.path.exists(path):
        time.sleep(0.05)


def run_server(args: EngineArgs, options: ServeOptions, startup: StartupTracker) -> int:
    """Open the port, load the engine in the background, serve until a signal; returns the exit code."""
    import uvicorn

    state = ServerState(startup)
    app = build_app(state, options)
    _quiet_access_log(options.disable_access_log_for_endpoints, options.root_path)
    config = uvicorn.Config(app, host=options.host, port=options.port, uds=options.uds,
                            http=http_protocol(options.request_head_timeout_s), log_level=options.uvicorn_log_level,
                            timeout_graceful_shutdown=options.shutdown_grace_s,
                            access_log=not options.disable_uvicorn_access_log,
                            **options.uvicorn_tls())
    outcome = {"exit_code": 0}

    def grace_expired(stopped_early: bool = False) -> None:
        state.stopping.set()
        engine = state.engine
        why = ("it was stopped by a second signal" if stopped_early else
               f"this request did not finish within --shutdown-grace-s ({options.shutdown_grace_s:g} s)")
        failed = engine.fail_all(f"the server is shutting down: {why}") if engine else 0
        if failed:
            logger.warning("%s: %d request(s) still open get a 503", "a second signal" if stopped_early else
                           f"shutdown grace period ({options.shutdown_grace_s:g} s) ran out", failed)

    server = _make_uvicorn_server(config, grace_expired)

    def stop(code: int) -> None:
        outcome["exit_code"] = code
        server.should_exit = True

    def load() -> None:
        if options.uds:
            _socket_mode_from_umask(options.uds, server)
        try:
            _hold_startup(options.startup_hold_file)
            start_engine(state, args, options)
        except BaseException as exc:  # noqa: BLE001 - any start-up failure ends the process, visibly
            log_startup_failure(exc, startup.phase)
            startup.fail(f"{type(exc).__name__}: {exc}")
            stop(1)
            return
        state.engine.on_death = lambda exc: stop(1)
        logger.info("serving %s on %s", state.served_model_names[0], options.listen_address)
        if in_container() and options.on_loopback:
            logger.warning("serving on %s inside a container: a published port cannot reach it; --host 0.0.0.0 "
                           "(vLLM's default) listens on the container's network", options.host)
        state.engine.run_in_this_thread()  # until shutdown

    loader = threading.Thread(target=load, name="pagedserve-engine", daemon=True)  # loads, then runs the loop
    loader.start()
    try:
        server.run()
    finally:
        if state.engine is not None:
            state.engine.shutdown()
        if options.uds and server.started:
            with contextlib.suppress(OSError):
                os.unlink(options.uds)  # ours: Python 3.11's asyncio leaves the socket file behind
    code = 1 if not server.started and outcome["exit_code"] == 0 else outcome["exit_code"]  # 1: no port (logged)
    if loader.is_alive() and state.engine is None:
        _leave_during_startup(startup, code)
    logger.info("stopped (exit code %d)", code)
    return code


def _leave_during_startup(startup: StartupTracker, code: int) -> None:
    """Stopped (SIGTERM/SIGINT) while the engine loads: the loader thread may be inside native code (a GGUF's
    dequantization, torch's thread pool), and finalizing the interpreter under it aborted the process (SIGABRT,
    exit 134). Nothing is served yet: stop any rank processes and leave at once with `code`."""
    import sys

    import psutil

    logger.info("stopped during start-up (phase %s)", startup.phase)  # read now: loading goes on meanwhile
    children = psutil.Process().children(recursive=True)
    for child in children:
        child.kill()  # tensor-parallel ranks ignore SIGTERM (rank 0 stops them); they hold nothing to save yet
    psutil.wait_procs(children, timeout=5)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
