"""`pagedserve run-batch -i INPUT.jsonl -o OUTPUT.jsonl [MODEL] [serve flags]`: a file of OpenAI Batch API
requests run through the server's own routes, in-process (vLLM's `vllm run-batch`).

Each input line is {"custom_id", "method": "POST", "url", "body": {...}}, the url one of URLS (chat,
completions, embeddings, score, rerank); each output line, in input order, is {"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}: the body the server would have answered, errors included (a
line that is not a request gets status 400 and an `error`). The requests go to the app through httpx's ASGI
transport, so a batch gets exactly what the HTTP API gives, with every request in one continuous batch (at most
--max-concurrency in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pagedserve.cli.common import USER_FACING_ERRORS, apply_thread_args, fail, setup_logging
from pagedserve.config import json_object

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank",
        "/v2/rerank")  # vLLM's


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedserve.cli.serve import add_serve_flags

    parser = subparsers.add_parser(
        "run-batch", help="Run a file of OpenAI Batch API requests (vLLM's run-batch).",
        description="Run a JSONL file of OpenAI Batch API requests (chat, completions, embeddings) through the "
                    "server's routes in-process and write one response line per request, in input order. "
                    "Takes serve's flags for the model and engine.")
    parser.add_argument("-i", "--input-file", required=True, help="JSONL requests ('-' for standard input).")
    parser.add_argument("-o", "--output-file", required=True, help="JSONL responses ('-' for standard output).")
    parser.add_argument("--max-concurrency", type=int, default=256, help="Requests in flight at once (default 256).")
    add_serve_flags(parser)
    parser.set_defaults(func=run)


def parse_line(number: int, text: str) -> dict:
    """One input line as a request; ValueError naming the line and what is wrong."""
    request = json_object(text, f"line {number}")
    if request.get("method", "POST") != "POST":
        raise ValueError(f"line {number}: method must be POST, got {request.get('method')!r}")
    if request.get("url") not in URLS:
        raise ValueError(f"line {number}: url must be one of {', '.join(URLS)}, got {request.get('url')!r}")
    if not isinstance(request.get("body"), dict):
        raise ValueError(f"line {number}: body must be a JSON object")
    if request["body"].get("stream"):
        raise ValueError(f"line {number}: stream is not available in a batch")
    if not isinstance(request.get("custom_id"), str) or not request["custom_id"]:
        raise ValueError(f"line {number}: custom_id must be a non-empty string (it names the line's output)")
    return request


def _custom_id(text: str) -> Any:
    """A line's custom_id where it is a JSON object that has one, even if it is not a valid request."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value.get("custom_id") if isinstance(value, dict) else None


def output_line(custom_id: Any, status: int, body: Any, error: str | None = None) -> dict:
    return {"id": f"batch-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"batch-req-{uuid.uuid4().hex}", "body": body},
            "error": None if error is None else {"message": error}}


async def run_lines(app: Any, lines: list[tuple[int, str]], max_concurrency: int,
                    write: Callable[[dict], None] | None = None) -> list[dict]:
    """Every (line number, line) through `app`, at most `max_concurrency` at a time; the output lines in input
    order, each passed to `write` as soon as it and every line before it are done (a long batch's output grows as
    it runs). A line that fails in any way is an output line with its error, never the end of the batch; so is a
    custom_id an earlier line already used."""
    import httpx

    first_line: dict[str, int] = {}
    repeats: dict[int, str] = {}
    for number, text in lines:
        custom_id = _custom_id(text)
        if isinstance(custom_id, str):
            if custom_id in first_line:
                repeats[number] = f"line {number}: custom_id {custom_id!r} repeats line {first_line[custom_id]}'s"
            else:
                first_line[custom_id] = number

    gate = asyncio.Semaphore(max(1, max_concurrency))
    # raise_app_exceptions=False: a server fault answers that line with a 500, as it would over HTTP
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        async def one(number: int, text: str) -> dict:
            if number in repeats:
                return output_line(_custom_id(text), 400, None, repeats[number])
            try:
                request = parse_line(number, text)
            except ValueError as exc:
                return output_line(_custom_id(text), 400, None, str(exc))
            custom_id = request.get("custom_id")
            # The body as an HTTP client sends it: JSON with \u escapes, so a lone surrogate reaches the server
            content = json.dumps(request["body"]).encode()
            try:
                async with gate:
                    response = await client.post(request["url"], content=content,
                                                 headers={"content-type": "application/json"})
            except Exception as exc:  # noqa: BLE001 - this line's failure, written to its output line
                return output_line(custom_id, 500, None, f"line {number}: {type(exc).__name__}: {exc}")
            return _response_line(custom_id, response)

        tasks = [asyncio.ensure_future(one(number, line)) for number, line in lines]
        results = []
        for task in tasks:  # in input order, each as soon as it is done
            results.append(await task)
            if write is not None:
                write(results[-1])
        return results


def _response_line(custom_id: Any, response: Any) -> dict:
    try:
        body = response.json()
    except ValueError:  # a fault's plain-text 500
        return output_line(custom_id, response.status_code, None, response.text or f"HTTP {response.status_code}")
    error = None
    if response.status_code >= 400:
        error = body.get("error", {}).get("message") if isinstance(body, dict) else None
        error = error or f"HTTP {response.status_code}"
    return output_line(custom_id, response.status_code, body, error)


def _read_lines(path: str) -> list[tuple[int, str]]:
    """The input's lines, numbered as in the file, blank ones skipped."""
    if path == "-":
        return [(i + 1, line) for i, line in enumerate(sys.stdin.read().splitlines()) if line.strip()]
    text = _flag_error("--input-file", path, lambda: open(path, encoding="utf-8").read())
    return [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]


def _flag_error(flag: str, path: str, action: Any) -> Any:
    """action(), its OSError as a ValueError naming the flag ("[Errno 21] Is a directory" named neither)."""
    try:
        return action()
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not UTF-8 text (a JSONL file of requests)") from None
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    apply_thread_args(args)
    setup_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    from pagedserve.cli.serve import checked_settings
    from pagedserve.engine.startup import StartupTracker
    from pagedserve.entrypoints.openai.api_server import ServerState, build_app, start_engine

    output = None if args.output_file == "-" else args.output_file
    try:
        engine_args, options = checked_settings(args)
        options = replace(options, api_key=None, disable_log_stats=True)  # in-process: no key, no stats line
        if args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
        lines = _read_lines(args.input_file)
        # Checked before the model loads (an output that cannot be written fails now, not after the batch ran),
        # and not emptied until it does: a typo in the model name kept a previous output.
        existed = output is not None and os.path.exists(output)
        if output is not None:
            _flag_error("--output-file", output, lambda: open(output, "a", encoding="utf-8").close())
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    state = ServerState(StartupTracker())
    started = threading.Event()
    failure: list[BaseException] = []

    def load_and_run() -> None:  # the engine's loop runs on the thread that built and warmed it up
        try:
            start_engine(state, engine_args, options)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failure.append(exc)
            return
        finally:
            started.set()
        state.engine.run_in_this_thread()

    threading.Thread(target=load_and_run, name="pagedserve-engine", daemon=True).start()
    started.wait()
    if failure:
        if output is not None and not existed:
            os.remove(output)  # created by the check above
        if isinstance(failure[0], (ValueError, *USER_FACING_ERRORS)):
            return fail(str(failure[0]))
        raise failure[0]

    out = sys.stdout if output is None else open(output, "w", encoding="utf-8")

    def write(result: dict) -> None:
        out.write(json.dumps(result, ensure_ascii=False) + "\n")
        out.flush()

    try:
        results = asyncio.run(run_lines(build_app(state, options), lines, args.max_concurrency, write))
    finally:
        state.engine.shutdown()
        if out is not sys.stdout:
            out.close()
    failed = sum(1 for result in results if result["error"] is not None)
    print(f"run-batch: {len(results)} requests, {failed} failed", file=sys.stderr)
    return 0
