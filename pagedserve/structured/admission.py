"""Requests waiting for their grammar to compile: held here, outside the scheduler, so they hold no KV
blocks and never block the requests behind them; each step the engine admits those whose grammar is ready
and fails those whose grammar was rejected or took longer than the compile time limit."""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pagedserve.exceptions import InvalidRequestError


@dataclass
class _Waiting:
    request: Any  # pagedserve.request.Request
    future: Future
    deadline: float


class GrammarAdmission:
    def __init__(self, compile_timeout_s: float) -> None:
        self.compile_timeout_s = compile_timeout_s
        self._waiting: dict[str, _Waiting] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def hold(self, request: Any, future: Future) -> None:
        self._waiting[request.request_id] = _Waiting(request, future, time.monotonic() + self.compile_timeout_s)

    def discard(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._waiting.pop(request_id, None)

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s for a compilation to finish (when the engine has nothing else to do)."""
        if self._waiting:
            concurrent.futures.wait([w.future for w in self._waiting.values()], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def take_ready(self) -> tuple[list[Any], dict[str, BaseException]]:
        """(requests whose grammar is compiled, with request.grammar set; request id -> error for the rest
        that cannot be served). Requests still compiling within their time limit stay."""
        ready, failed = [], {}
        now = time.monotonic()
        for request_id, waiting in list(self._waiting.items()):
            if waiting.future.done():
                del self._waiting[request_id]
                error = waiting.future.exception()
                if error is not None:
                    failed[request_id] = error
                else:
                    waiting.request.grammar = waiting.future.result()
                    ready.append(waiting.request)
            elif now > waiting.deadline:
                del self._waiting[request_id]
                failed[request_id] = compile_timeout_error(self.compile_timeout_s,
                                                           waiting.request.sampling_params.structured_outputs)
        return ready, failed


def compile_timeout_error(timeout_s: float, params: Any) -> InvalidRequestError:
    param = getattr(params, "param", "structured_outputs")
    return InvalidRequestError(f"{param}: compiling the grammar took longer than {timeout_s:g} s (the limit set by "
                               "--structured-outputs-config's compile_timeout_s); the compile goes on in the "
                               "background and is used once done, so retry later, or simplify the schema",
                               param=param)
