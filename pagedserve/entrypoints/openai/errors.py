"""Every error the API returns is built here: OpenAI-style bodies, one mapping from exceptions to status."""

from __future__ import annotations

import json
import logging
import uuid
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from pagedserve.exceptions import InvalidRequestError

logger = logging.getLogger("pagedserve.server")

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error with its HTTP status, OpenAI `type`, and the offending parameter if any."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers
        self.request_id = request_id  # set on 500s: the id the server's log files the traceback under


_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          408: "RequestTimeoutError", 413: "RequestTooLargeError", 422: "UnprocessableEntityError",
          429: "RateLimitError",
          499: "ClientClosedRequest", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def _printable(text: str | None) -> str | None:
    """Text that encodes as UTF-8: a client's lone surrogate quoted in a message is written as \\udXXX (a
    message holding one could not be sent: a 500 instead of the error)."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status: int, param: str | None = None, code: str | None = None,
               request_id: str | None = None) -> dict:
    message, param = _printable(message), _printable(param)
    error = {"message": message, "type": _TYPES.get(status) or HTTPStatus(status).phrase, "param": param,
             "code": code if code is not None else status}
    if request_id is not None:
        error["request_id"] = request_id
    return {"error": error}


def api_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.status, error.param, error.code, error.request_id),
                        status_code=error.status, headers=error.headers)


def error_response(message: str, status: int, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return api_error_response(APIError(message, status, param, code, headers))


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception raised while serving a request to an APIError: the one place that decides a status.

    Only InvalidRequestError is the client's fault (400, its field as `param`); an unexpected exception
    is a 500 whose body carries a request id, under which its traceback is logged here.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(exc.message, 400, param=exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(f"the server is busy: {exc}; retry later", 429,
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503)
    if isinstance(exc, RequestFailedError):  # the engine logged the traceback when the request failed
        return APIError(f"internal error while serving request {exc.request_id}: {exc.reason}; the server "
                        "keeps serving other requests", 500, request_id=exc.request_id)
    request_id = f"err-{uuid.uuid4().hex}"
    logger.error("internal error, request %s: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
    return APIError(f"internal error (request {request_id}): {type(exc).__name__}: {exc}", 500,
                    request_id=request_id)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg')}", None
    if not location and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return ("the request body must be a JSON object, sent with Content-Type: application/json (curl: add "
                "-H 'Content-Type: application/json')"), None
    branches = _union_branches(errors, location)
    if branches:  # a value of none of a field's types: name the field, and what each type wanted
        param = ".".join(location[:-len(branches[0][0])])
        wanted = "; or ".join(dict.fromkeys(f"{kind}{' ' + '.'.join(rest) if rest else ''}: {msg}"
                                            for (kind, *rest), msg in branches))
        return f"{param}: none of its forms fits ({wanted})", param
    param = ".".join(location) or None
    return f"{param or 'body'}: {first.get('msg')}", param


def _union_branches(errors: list, location: list[str]) -> list[tuple[list[str], str]]:
    """Where the first errors are one value's failures against each type of a union (pydantic adds the type's
    name to each location: "documents.0.str", "documents.0.RerankDocument.text"), each one's location past the
    value (type name first) and message; else [] (the param named a union member, QA-T)."""
    locations = [[str(p) for p in error.get("loc", ()) if p != "body"] for error in errors]
    for depth in range(len(location) - 1, 0, -1):
        prefix = location[:depth]
        same = [(loc[depth:], error.get("msg", "")) for loc, error in zip(locations, errors) if loc[:depth] == prefix
                and len(loc) > depth]
        kinds = {rest[0] for rest, _ in same}
        if len(kinds) > 1 and all(_is_type_name(kind) for kind in kinds):
            return same
    return []


def _is_type_name(part: str) -> bool:
    """A location part pydantic names a union member by (str, list[str], RerankDocument, function-after[...]), not
    a field (snake_case) or an index: two errors on two fields of one object are not a union's."""
    return part in ("str", "int", "float", "bool", "none", "bytes") or part[:1].isupper() or any(
        mark in part for mark in "[-")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(json.JSONDecodeError)
    async def _json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(f"malformed JSON body: {exc}", 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # request_body.py words the bodies that cannot be read; a 405 carries its Allow (RFC 9110)
        return error_response(str(exc.detail), exc.status_code, headers=exc.headers)

    async def _mapped(_: Request, exc: Exception) -> JSONResponse:
        return api_error_response(to_api_error(exc))

    # The expected failures get their own handlers: Starlette answers those and keeps the connection.
    # A handler for bare Exception runs in its outermost middleware, which re-raises after answering,
    # and uvicorn then closes the keep-alive connection under the client (a pooled client sees a reset).
    for expected in (QueueFullError, EngineDeadError, InvalidRequestError, RequestFailedError):
        app.add_exception_handler(expected, _mapped)
    app.add_exception_handler(Exception, _mapped)  # a real bug: answered as 500, logged, connection closed
