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
import collections
import io
import json
import logging
import os
import stat
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, TextIO

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
    parser.add_argument("-i", "--input-file", required=True,
                        help="JSONL requests: a file, an http(s) URL, or '-' for standard input.")
    parser.add_argument("-o", "--output-file", required=True,
                        help="JSONL responses: a file, an http(s) URL (uploaded with PUT at the end), or '-' for "
                             "standard output.")
    parser.add_argument("--max-concurrency", type=int, default=256, help="Requests in flight at once (default 256).")
    parser.add_argument("--output-tmp-dir", default=None,
                        help="Where an --output-file URL's output is written before it is uploaded (default: the "
                             "system's temporary folder).")
    parser.add_argument("--enable-metrics", action="store_true",
                        help="Serve Prometheus metrics (the server's /metrics) at --url:--port while the batch runs.")
    parser.add_argument("--url", default="127.0.0.1", help="With --enable-metrics: the address (default 127.0.0.1).")
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


async def run_lines(app: Any, lines: Iterable[tuple[int, str]], max_concurrency: int,
                    write: Callable[[dict], None]) -> tuple[int, int]:
    """Every (line number, line) through `app`, at most `max_concurrency` at a time; the output lines in input
    order, each passed to `write` as soon as it and every line before it are done (a long batch's output grows as
    it runs). Lines are read as the batch goes, at most twice `max_concurrency` ahead of the oldest unanswered one,
    and nothing is kept once written: memory does not grow with the file. A line that fails in any way is an output
    line with its error, never the end of the batch; so is a custom_id an earlier line already used. Returns
    (lines, failed lines)."""
    import httpx

    gate = asyncio.Semaphore(max(1, max_concurrency))
    first_line: dict[str, int] = {}  # each custom_id's line (the one thing kept per line, to find repeats)
    # raise_app_exceptions=False: a server fault answers that line with a 500, as it would over HTTP
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        async def one(number: int, text: str, repeat: str | None) -> dict:
            if repeat is not None:
                return output_line(_custom_id(text), 400, None, repeat)
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

        pending: collections.deque[asyncio.Future] = collections.deque()
        counts = [0, 0]

        async def write_oldest() -> None:
            result = await pending.popleft()
            write(result)
            counts[0] += 1
            counts[1] += result["error"] is not None

        for number, text in lines:
            custom_id, repeat = _custom_id(text), None
            if isinstance(custom_id, str):
                if custom_id in first_line:
                    repeat = f"line {number}: custom_id {custom_id!r} repeats line {first_line[custom_id]}'s"
                else:
                    first_line[custom_id] = number
            pending.append(asyncio.ensure_future(one(number, text, repeat)))
            while len(pending) >= 2 * max(1, max_concurrency):
                await write_oldest()
        while pending:
            await write_oldest()
        return counts[0], counts[1]


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


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def _open_input(path: str) -> TextIO:
    """The input, checked before the model loads (ValueError naming --input-file): standard input, an http(s) URL
    (fetched whole, as vLLM's run-batch GETs it), or a file (read through once for UTF-8, then read again line by
    line as the batch runs; a pipe such as <(...) or /dev/stdin, which reads once, is read whole: it gave nothing
    the second time, and the batch ran no request)."""
    if path == "-":
        return sys.stdin
    if _is_url(path):
        import httpx

        try:
            response = httpx.get(path, timeout=60.0, follow_redirects=True)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ValueError(f"--input-file {path}: {exc}") from None
        try:
            return io.StringIO(response.content.decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"--input-file {path}: not UTF-8 text (a JSONL file of requests)") from None

    def check() -> TextIO:
        if not stat.S_ISREG(os.stat(path).st_mode):
            with open(path, encoding="utf-8") as handle:
                return io.StringIO(handle.read())
        with open(path, encoding="utf-8") as handle:
            for _ in iter(lambda: handle.read(1 << 20), ""):
                pass
        return open(path, encoding="utf-8")
    return _flag_error("--input-file", path, check)


def _numbered_lines(source: TextIO) -> Iterator[tuple[int, str]]:
    """The input's lines, numbered as in the file, blank ones skipped."""
    for number, line in enumerate(source, start=1):
        if line.strip():
            yield number, line.rstrip("\r\n")


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

    upload = args.output_file if _is_url(args.output_file) else None  # written to a file, then PUT there
    try:
        engine_args, options = checked_settings(args)
        options = replace(options, api_key=None, disable_log_stats=True)  # in-process: no key, no stats line
        if args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
        source = _open_input(args.input_file)
        if upload is not None:
            folder = args.output_tmp_dir or tempfile.gettempdir()
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise ValueError(f"--output-tmp-dir {folder}: not a folder this process can write to")
            output = os.path.join(folder, f"run-batch-{uuid.uuid4().hex}.jsonl")
        else:
            output = None if args.output_file == "-" else args.output_file
        # Checked before the model loads (an output that cannot be written fails now, not after the batch ran),
        # and not emptied until it does: a typo in the model name kept a previous output.
        existed = output is not None and os.path.exists(output)
        if existed and isinstance(source, io.TextIOWrapper) and source is not sys.stdin and os.path.samefile(
                args.input_file, output):  # the input is read as the batch runs: opening the output emptied it
            raise ValueError(f"--output-file {args.output_file} is the --input-file: the input is read as the "
                             "batch runs, so writing there would erase it; name another output file")
        if output is not None:
            _flag_error("--output-file", output, lambda: open(output, "a", encoding="utf-8").close())
        state = ServerState(StartupTracker())
        if args.enable_metrics:  # vLLM's: Prometheus metrics while the batch runs (a port in use fails here)
            from prometheus_client import start_http_server

            _flag_error("--port", str(args.port), lambda: start_http_server(args.port, addr=args.url,
                                                                             registry=state.registry))
            print(f"run-batch: metrics on http://{args.url}:{args.port}/metrics", file=sys.stderr)
    except (ValueError, OSError) as exc:
        return fail(str(exc))
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
        total, failed = asyncio.run(run_lines(build_app(state, options), _numbered_lines(source),
                                              args.max_concurrency, write))
    finally:
        state.engine.shutdown()
        if out is not sys.stdout:
            out.close()
        if source is not sys.stdin:
            source.close()
    print(f"run-batch: {total} requests, {failed} failed", file=sys.stderr)
    if upload is not None:
        return _upload(output, upload)
    return 0


def _upload(path: str, url: str) -> int:
    """PUT the output file to --output-file's URL (vLLM's run-batch does); the file is kept where it fails."""
    import httpx

    try:
        with open(path, "rb") as handle:
            httpx.put(url, content=handle, timeout=600.0).raise_for_status()
    except httpx.HTTPError as exc:
        print(f"pagedserve: error: --output-file {url}: the upload failed ({exc}); the output is in {path}",
              file=sys.stderr)
        return 1
    os.remove(path)
    return 0
