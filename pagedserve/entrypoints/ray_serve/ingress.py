"""The front deployment: picks each request's routing key and forwards it to an engine replica; answers /health,
/metrics and /replicas for all replicas at once.

Routes here: `/health` (200 while at least one replica is ready; each replica's own /health body under
`replicas`), `/metrics` (every replica's Prometheus text, each sample labelled `replica="<id>"`), `/replicas`
(id, Ray actor name, node and /health status of each), `/replicas/{id}/health` and `/replicas/{id}/metrics`
(one replica's own). Everything else goes to a replica unchanged; its answer comes back with an
`x-pagedserve-replica` header. A replica whose engine is dead (or not started) refuses a request before any of it
runs, and the next replica in the key's order is asked instead. A replica that dies (or is unreachable) before
answering gives 503 with an OpenAI-style body; one that dies in the middle of a stream ends it with an error event,
as the server does for errors after the headers.

Two Ray Serve constraints shape this module: no `from __future__ import annotations` (its class-based FastAPI
views read the route methods' annotations as objects; a string `Request` would be taken for a query parameter),
and every helper the class uses is defined above it (serve.ingress captures the class with the module globals
that exist when it is decorated).
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from pagedserve.entrypoints.openai.errors import error_body
from pagedserve.entrypoints.ray_serve.replica import ForwardedRequest, ResponseStart
from pagedserve.entrypoints.ray_serve.routing import PINNED_PREFIX, forwarded_headers, known_replicas, routing_key

logger = logging.getLogger("pagedserve.ray_serve")

api = FastAPI(title="pagedserve on Ray Serve")
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
# A replica that does not answer within these is reported as such (/health) or left out (/metrics): one hung or
# starting replica held both for 10 s, past a health probe's timeout, while the others served at once.
HEALTH_TIMEOUT_S = 2.0
METRICS_TIMEOUT_S = 5.0


@dataclass
class ReplicaReply:
    """A whole reply of one replica to a pinned GET (health and metrics fan-out)."""

    replica: str
    status: int
    body: bytes

    def json(self) -> dict:
        try:
            return json.loads(self.body)
        except ValueError:
            return {"body": self.body.decode(errors="replace")}


def failure_response(exc: BaseException) -> JSONResponse:
    """A request that no replica answered: 429 when all are full, 503 when the replica stopped or failed."""
    if isinstance(exc, BackPressureError):
        return JSONResponse(error_body(f"every replica is busy: {exc}; retry later", 429), 429,
                            headers={"Retry-After": "1"})
    return JSONResponse(error_body(_failure_message(exc), 503), 503, headers={"Retry-After": "1"})


def _failure_message(exc: BaseException) -> str:
    if isinstance(exc, RayActorError):
        return ("the replica serving this request stopped (its Ray actor died) before it answered; Ray Serve "
                "is replacing it and the other replicas keep serving: retry the request")
    if isinstance(exc, StopAsyncIteration):
        return "the replica serving this request ended without an answer; retry the request"
    return f"the replica serving this request failed: {type(exc).__name__}: {exc}; retry the request"


async def _rest_of_stream(stream: DeploymentResponseGenerator, replica: str) -> AsyncIterator[bytes]:
    """The body chunks after the start; a replica lost mid-stream ends it with an SSE error event. A client
    that leaves closes this iterator: the replica's call is cancelled, and its app aborts the request."""
    try:
        async for chunk in stream:
            yield chunk
    except (RayError, BackPressureError) as exc:
        logger.warning("replica %s lost in the middle of a stream: %s", replica, exc)
        error = json.dumps(error_body(_failure_message(exc), 503))
        yield f"data: {error}\n\ndata: [DONE]\n\n".encode()
    finally:
        stream.cancel()  # a no-op once the stream has ended


async def _body_within(raw: Request, limit: int) -> Optional[bytes]:
    """The request's body, or None when it is larger than `limit` bytes: by its Content-Length, or (a chunked
    body, which says its size only as it arrives) once more than that has arrived."""
    length = raw.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return None
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _is_event_stream(start: ResponseStart) -> bool:
    return any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
               for name, value in start.headers)


def _headers(start: ResponseStart) -> dict[str, str]:
    """The replica's headers, less those the response here sets itself."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in start.headers
            if name.lower() not in (b"content-length", b"transfer-encoding", b"connection")}


def merge_metrics(texts: dict[str, str]) -> str:
    """Several replicas' Prometheus texts as one, each sample labelled with its replica."""
    families: dict[str, object] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, type(family)(family.name, family.documentation, family.type,
                                                                   family.unit))
            merged.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                               for s in family.samples]

    class Merged:
        def collect(self) -> list:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry).decode()


@serve.ingress(api)
class Ingress:
    def __init__(self, engine: DeploymentHandle, engine_deployment: str, prefix_chars: int,
                 max_body_bytes: int) -> None:
        self.engine = engine
        self.engine_deployment = engine_deployment
        self.app_name = serve.get_replica_context().app_name
        self.prefix_chars = prefix_chars
        self.max_body_bytes = max_body_bytes

    @api.get("/health")
    async def health(self) -> JSONResponse:
        replies, silent = await self._fan_out("/health", HEALTH_TIMEOUT_S)
        num_ready = sum(r.status == 200 for r in replies)
        states = {r.replica: {"status_code": r.status, **r.json()} for r in replies}
        states.update({replica: {"status_code": None, "status": "not answering",
                                 "error": f"no answer to /health within {HEALTH_TIMEOUT_S:g} s"} for replica in silent})
        body = {"status": "ready" if num_ready else "starting", "num_replicas": len(states),
                "num_ready": num_ready, "replicas": states}
        return JSONResponse(body, status_code=200 if num_ready else 503)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        replies, _ = await self._fan_out("/metrics", METRICS_TIMEOUT_S)
        text = merge_metrics({r.replica: r.body.decode() for r in replies if r.status == 200})
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @api.get("/replicas")
    async def replicas(self) -> dict:
        health = {r.replica: r.status for r in (await self._fan_out("/health", HEALTH_TIMEOUT_S))[0]}
        return {"replicas": [{**info, "health_status": health.get(info["replica"])} for info in self._listing()]}

    @api.get("/replicas/{replica}/{what}")
    async def one_replica(self, replica: str, what: str) -> Response:
        if what not in ("health", "metrics"):
            return JSONResponse(error_body(f"/replicas/{{id}}/{what} does not exist: health or metrics", 404), 404)
        reply = await self._get(replica, f"/{what}")
        if reply is None or reply.replica != replica:
            return JSONResponse(error_body(f"no replica {replica!r} is running; see /replicas", 404), 404)
        media_type = CONTENT_TYPE_LATEST if what == "metrics" else "application/json"
        return Response(reply.body, status_code=reply.status, media_type=media_type)

    @api.api_route("/{path:path}", methods=_METHODS)
    async def forward(self, raw: Request) -> Response:
        body = await _body_within(raw, self.max_body_bytes)
        if body is None:
            message = f"request body exceeds the limit of {self.max_body_bytes} bytes"
            return JSONResponse(error_body(message, 413), 413)
        headers = forwarded_headers(raw.scope["headers"], body)
        request = ForwardedRequest(raw.method, raw.url.path, raw.scope.get("raw_path") or raw.url.path.encode(),
                                   raw.scope.get("query_string", b""), headers, body,
                                   tuple(raw.client) if raw.client else None)
        key = routing_key(request.path, raw.headers, request.body, self.prefix_chars)
        try:
            stream, start = await self._first_answer(request, key)
            if not _is_event_stream(start):  # a whole JSON answer: gathered, so a failure is still a 503
                body = b"".join([chunk async for chunk in stream])
                return Response(body, status_code=start.status, headers=_headers(start))
        except (RayError, BackPressureError, StopAsyncIteration) as exc:
            return failure_response(exc)
        return StreamingResponse(_rest_of_stream(stream, start.replica), status_code=start.status,
                                 headers=_headers(start))

    async def _first_answer(self, request: ForwardedRequest,
                            key: Optional[str]) -> tuple[DeploymentResponseGenerator, ResponseStart]:
        """The stream and response start of the replica that takes the request. A replica that refuses it (its
        engine dead or not started: nothing of the request ran) is avoided and the next one asked, once each."""
        avoid: list[str] = []
        while True:
            stream = self.engine.options(stream=True).handle_http.remote(request, routing_key=key, avoid=tuple(avoid))
            start = await stream.__anext__()
            if not start.refused or start.replica in avoid or len(avoid) + 1 >= len(self._listing()):
                return stream, start
            logger.warning("replica %s refused %s %s (%d): asking the next one", start.replica, request.method,
                           request.path, start.status)
            avoid.append(start.replica)
            async for _ in stream:  # its 503 body, unused
                pass

    def _listing(self) -> list[dict]:
        return known_replicas(self.app_name, self.engine_deployment)

    async def _fan_out(self, path: str, timeout_s: float) -> tuple[list[ReplicaReply], list[str]]:
        """GET `path` from every replica the router knows; each reply once, under the replica that gave it, and
        the replicas that gave none within `timeout_s`. One at a time: Ray hands a chosen replica to the oldest
        waiting call, so calls pinned to different replicas at once can all land on one. Before the first call
        through the handle there is no router yet: one unpinned call makes it."""
        listed = [info["replica"] for info in self._listing()]
        replies: dict[str, ReplicaReply] = {}
        for replica in listed or [None]:
            try:
                reply = await asyncio.wait_for(self._get(replica, path), timeout_s)
            except asyncio.TimeoutError:
                logger.warning("replica %s did not answer %s within %g s", replica, path, timeout_s)
                continue
            if reply is not None:
                replies.setdefault(reply.replica, reply)
        return list(replies.values()), [replica for replica in listed if replica not in replies]

    async def _get(self, replica: str | None, path: str) -> ReplicaReply | None:
        """GET `path` from this replica (None: any), whole; None if no replica answered."""
        request = ForwardedRequest("GET", path, path.encode())
        key = PINNED_PREFIX + replica if replica else None
        stream = self.engine.options(stream=True).handle_http.remote(request, routing_key=key)
        try:
            start = await stream.__anext__()
            body = b"".join([chunk async for chunk in stream])
        except (RayError, BackPressureError, StopAsyncIteration) as exc:
            logger.warning("replica %s did not answer %s: %s", replica, path, exc)
            return None
        return ReplicaReply(start.replica, start.status, body)
