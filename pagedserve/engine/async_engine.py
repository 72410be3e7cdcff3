"""AsyncEngine: one engine thread stepping LLMEngine; asyncio callers get per-request output queues.

The HTTP event loop never runs model compute. Every engine call happens on the engine thread; callers
hand it commands through a thread-safe queue and receive outputs through asyncio queues.

A fault that belongs to one request (adding it, scheduling it, post-processing it, or a model step it was
in while the retry step works) fails that request with RequestFailedError and the thread goes on; only an
EngineDeadError (or a fault outside any request) ends the thread, failing every caller.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.exceptions import EngineDeadError, InvalidRequestError, RequestFailedError, request_error
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestFailedError"]


# How long check_room holds room for a response that has not started its requests (it takes milliseconds).
RESERVATION_S = 30.0
# A request whose caller has taken no output for STALLED_S while at least MAX_UNREAD_OUTPUTS wait for it is ended
# (a streaming client that stopped reading: its outputs piled up, ~28 KB a token with 20 logprobs, for as long as it
# generated, QA-U). Both: a caller that is only behind (a busy event loop) takes outputs all the time.
MAX_UNREAD_OUTPUTS = 64
STALLED_S = 20.0


@dataclass
class _Stream:
    """A request's outputs on their way to its caller, and when the caller last took one."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    taken_at: float
    ended: bool = False  # ended for not being read: nothing more is delivered


@dataclass(eq=False)  # by identity: held in a WeakSet
class Reservation:
    """Room check_room holds for requests a response is about to start (AsyncEngine.generate takes it)."""

    remaining: int
    expires: float  # time.monotonic()


def _busy(held: int) -> str:
    return f"{held} request{' is' if held == 1 else 's are'} already queued or running"


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the client should retry later."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    arrival_time: float | None


@dataclass
class _Abort:
    request_id: str


# Called on the engine thread after every step with (engine, outputs); used for metrics.
StepObserver = Callable[[LLMEngine, list[RequestOutput]], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None, start_thread: bool = True) -> None:
        """start_thread=False: the caller runs the loop itself with run_in_this_thread() (see there why)."""
        self.engine = engine
        self.observer = observer
        # requests the server holds at once (running plus waiting); past it a request gets QueueFullError (429)
        self.capacity = engine.config.scheduler.max_waiting_requests + engine.config.scheduler.max_num_seqs
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._reservations: weakref.WeakSet[Reservation] = weakref.WeakSet()  # check_room's, until generate()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        if start_thread:
            self._thread.start()

    def run_in_this_thread(self) -> None:
        """Run the engine loop here until shutdown. For the thread that built (and warmed up) the LLMEngine:
        OpenMP thread teams and per-thread kernel caches belong to the calling thread, so a loop on another
        thread would pay them again on its first request."""
        self._thread = threading.current_thread()
        self._run()

    @property
    def is_dead(self) -> bool:
        return self.error is not None

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._streams)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- caller side (asyncio) -------------------------------------------------------------------
    def check_room(self, num_requests: int) -> Reservation:
        """Before a response starts (a stream's 200 and headers): InvalidRequestError if `num_requests` alone are
        more than the server ever takes at once (a retry would never help), QueueFullError (429) if they do not
        fit now. The room is held for them: generate(reservation=...) takes it (streams that checked at once all
        passed, then met a full queue after their 200, as an error event). Room a caller never takes is given back
        when its Reservation is dropped, or after RESERVATION_S."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        capacity = self.capacity
        if num_requests > capacity:
            raise InvalidRequestError(f"this request holds {num_requests} prompts; the server takes at most "
                                      f"{capacity} at once (--max-num-seqs plus --max-waiting-requests): send fewer "
                                      "per request", param="prompt")
        with self._lock:
            held = len(self._streams) + self._reserved()
            if held + num_requests > capacity:
                raise QueueFullError(_busy(held))
            reservation = Reservation(num_requests, time.monotonic() + RESERVATION_S)
            self._reservations.add(reservation)
            return reservation

    def _reserved(self) -> int:
        """Room check_room holds for requests not registered yet (under the lock)."""
        now = time.monotonic()
        return sum(r.remaining for r in self._reservations if r.expires > now)

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                       arrival_time: float | None = None, admitted: bool = False,
                       reservation: Reservation | None = None) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Yield outputs until the request finishes; closing the iterator early aborts the request.
        With PoolingParams (an embedding model) the one output is a PoolingRequestOutput. `admitted`: part of a
        request check_room already let in (a beam search's later steps), so never a 429 half-way; `reservation`:
        check_room's for this request, whose room it takes."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if reservation is not None and reservation.remaining > 0 and reservation.expires > time.monotonic():
                reservation.remaining -= 1
                admitted = True
            held = len(self._streams) + self._reserved()
            if held >= self.capacity and not admitted:
                raise QueueFullError(_busy(held))
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            target = self._streams[request_id] = _Stream(asyncio.get_running_loop(), stream, time.monotonic())
        self._commands.put(_Add(request_id, prompt, params, arrival_time))
        finished = False
        try:
            while True:
                item = await stream.get()
                target.taken_at = time.monotonic()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def fail_all(self, message: str) -> int:
        """End every open request with EngineDeadError(message) (a 503, or a stream's error event), from any
        thread: the server's shutdown grace ran out. Each caller's generate() then aborts its request.
        Returns how many there were."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, EngineDeadError(message))
        return len(request_ids)

    # ---- engine thread ---------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is None or target.ended:
            return
        if (target.queue.qsize() >= MAX_UNREAD_OUTPUTS and not isinstance(item, BaseException)
                and time.monotonic() - target.taken_at > STALLED_S):
            target.ended = True
            logger.warning("request %s: its caller took no output for %.0f s while %d waited (a client that stopped "
                           "reading its stream): ended", request_id, STALLED_S, target.queue.qsize())
            item = RequestFailedError(request_id, f"the client read none of this request's output for {STALLED_S:g} "
                                                  "s: the request was ended")
            self._commands.put(_Abort(request_id))
        target.loop.call_soon_threadsafe(target.queue.put_nowait, item)

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            try:
                finals = self.engine.abort_request([command.request_id])
            except Exception:  # noqa: BLE001 - the caller is gone either way; the engine serves the others
                logger.exception("aborting request %s failed", command.request_id)
                return
            if finals and self.observer is not None:
                self.engine.refresh_gauges()
                self.observer(self.engine, finals)

    def _add(self, command: _Add) -> None:
        # A request with this id already in the engine is not this command's to clean up.
        is_new = not self.engine.output_processor.has_request(command.request_id)
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
        except InvalidRequestError as exc:  # the client's to fix: a 400
            self._deliver(command.request_id, exc)
        except Exception as exc:  # noqa: BLE001 - a fault adding this request fails it, not the engine
            logger.error("request %s failed while being added: %s: %s", command.request_id, type(exc).__name__,
                         exc, exc_info=exc)
            if is_new:
                self.engine.abort_request([command.request_id])  # whatever part of it was registered
            self._deliver(command.request_id, RequestFailedError(command.request_id, f"{type(exc).__name__}: {exc}"))

    def _report_failed(self) -> None:
        for request_id, reason in self.engine.take_failed().items():
            self._deliver(request_id, request_error(request_id, reason))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # Idle, or only requests held by memory pressure: wait up to 0.5 s for a command (no spinning).
                self._drain_commands(block=not self.engine.has_unfinished_requests() or self.engine.is_held())
                self.engine.check_health()  # at least every 0.5 s while idle: a lost rank ends the engine
                if not self.engine.has_unfinished_requests():
                    self.engine.idle()  # KV pages given back under pressure, freed grammars' heap trimmed
                    continue
                outputs = self.engine.step()
                self._report_failed()
                for output in outputs:
                    self._deliver(output.request_id, output)
                if self.observer is not None:
                    self.observer(self.engine, outputs)
        except BaseException as exc:  # the engine is unusable now: fail every caller, report death
            logger.exception("engine thread died")
            self.error = exc
            self.fail_all(f"the engine stopped: {exc}")
            if self.on_death is not None:
                self.on_death(exc)
