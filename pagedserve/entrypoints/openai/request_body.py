"""Reading a request's JSON body: one that cannot be read is refused with the reason.

FastAPI parses a JSON body with `Request.json()` and answers every failure other than a JSON syntax error with
"There was an error parsing the body". Routes here get a Request whose `json()` names the reason instead (an
HTTPException, which FastAPI passes on as it is): a Content-Encoding this server does not decode, bytes that
are not UTF-8, or nesting past what the parser can follow. A syntax error stays FastAPI's `json_invalid`
validation error (errors.py words it). FastAPI documents this way of customising a request ("Custom Request
and APIRoute class").
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException


def parse_json_body(body: bytes, content_encoding: str | None) -> Any:
    """The JSON value of `body`; an HTTP 400 saying why where it cannot be read (json.JSONDecodeError is raised
    as it is, for the caller's syntax-error message)."""
    if content_encoding and content_encoding.strip().lower() != "identity":
        raise HTTPException(400, f"the body is sent with Content-Encoding {content_encoding!r}, which this server "
                                 "does not decode: send it uncompressed")
    try:
        return json.loads(body)
    except UnicodeDecodeError as exc:
        raise HTTPException(400, f"the body is not UTF-8 (byte {exc.start}): a JSON body must be UTF-8") from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # int() of a number literal past Python's digit limit (str-to-int conversion)
        raise HTTPException(400, f"the body holds a number of more than {sys.get_int_max_str_digits()} digits, "
                                 "which no field here takes") from None
    except RecursionError:  # json's scanner follows nesting on the C stack
        raise HTTPException(400, "the body nests too deep to read: JSON values here must nest fewer than 1000 "
                                 "levels") from None


class JSONBodyRequest(Request):
    """A Request whose JSON body is read by parse_json_body."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body(), self.headers.get("content-encoding"))
        return self._json


class JSONBodyRoute(APIRoute):
    """An APIRoute whose endpoint (and FastAPI's body parsing) gets a JSONBodyRequest."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def with_json_body(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return with_json_body
