"""One streamed OpenAI-compatible request, timed chunk by chunk into a `RequestRecord`."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from pagedserve.benchmarks.embeddings import EMBEDDINGS, build_embedding_body, send_embedding_request
from pagedserve.benchmarks.metrics import RequestRecord

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS, EMBEDDINGS)  # embeddings: not streamed (benchmarks/embeddings.py)


def build_request_body(
    endpoint: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    ignore_eos: bool,
    temperature: float = 0.0,
    sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Streamed request asking for usage in the final chunk. `ignore_eos` is a vLLM extra parameter; `sampling`
    more sampling fields (top_p, top_k, min_p)."""
    if endpoint == EMBEDDINGS:
        return build_embedding_body(model, prompt)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == CHAT_COMPLETIONS:
        if not isinstance(prompt, str):
            raise ValueError("chat prompts must be text, not token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(sampling or {})
    return body


def _chunk_text(choice: dict[str, Any], endpoint: str) -> str | None:
    """Text carried by one streamed choice: None when the chunk has no text field at all."""
    if endpoint == CHAT_COMPLETIONS:
        delta = choice.get("delta") or {}
        if "role" in delta and not delta.get("content"):
            return None  # the role announcement that opens a chat stream: no token yet
        return delta.get("content")
    return choice.get("text")


def _consume_event(data: dict[str, Any], record: RequestRecord, endpoint: str, now: float) -> None:
    """Fold one SSE data object into `record` (token chunk, finish reason, usage).

    A token chunk is a choice with a text field, even an empty one: pagedserve and vLLM send one chunk
    per generated token, and a token whose bytes end inside a UTF-8 character arrives as '' (the
    detokenizer holds them back). Not token chunks: the chat role announcement, a choice without any
    text field (e.g. a closing `delta: {}` that only carries finish_reason), and the usage chunk.
    """
    if "error" in data and not data.get("choices"):
        error = data["error"]
        message = error.get("message") if isinstance(error, dict) else str(error)
        raise RuntimeError(f"server error in stream: {message}")
    for choice in data.get("choices") or []:
        text = _chunk_text(choice, endpoint)
        if isinstance(text, str):
            if record.first_token_time is None:
                record.first_token_time = now
            record.chunk_times.append(now)
            record.num_token_chunks += 1
            record.num_empty_chunks += 0 if text else 1
            record.generated_text += text
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = data.get("usage")
    if usage:
        # Servers with continuous usage stats send it on every chunk: the last one wins.
        record.output_tokens = usage.get("completion_tokens")
        record.prompt_tokens = usage.get("prompt_tokens")


async def _read_stream(response: httpx.Response, record: RequestRecord, endpoint: str) -> None:
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, "event:" lines
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            break
        _consume_event(json.loads(payload), record, endpoint, time.perf_counter())


def _finish(record: RequestRecord) -> None:
    """Set success and the usage flags once the stream has closed."""
    if record.num_token_chunks == 0 and record.output_tokens in (None, 0):
        record.error = "stream closed without any token"
        return
    record.success = True
    record.usage_missing = record.output_tokens is None
    record.usage_mismatch = record.output_tokens is not None and record.output_tokens != record.num_token_chunks


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord, endpoint: str
) -> RequestRecord:
    """POST a streamed request and fill `record` with its timings, counts and outcome. Never raises."""
    if endpoint == EMBEDDINGS:
        return await send_embedding_request(client, url, body, record)
    record.max_tokens = body.get("max_tokens", 0)
    record.ignore_eos = bool(body.get("ignore_eos", False))
    record.send_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                record.error = f"HTTP {response.status_code}: {detail}"
            elif "text/event-stream" not in response.headers.get("content-type", ""):
                record.error = "server did not stream (no text/event-stream); TTFT cannot be measured"
            else:
                await _read_stream(response, record, endpoint)
                _finish(record)
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:  # ValueError: bad JSON in a chunk
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        record.success = False
    record.end_time = time.perf_counter()
    return record


def server_url(url: str) -> str:
    """A server's root URL as a user may give it: `127.0.0.1:8000` (no scheme) is http://; a trailing /v1 (the
    OpenAI client's base URL) is dropped, as routes are asked with their /v1."""
    url = url.rstrip("/")
    if url and not url.startswith(("http://", "https://", "unix:")):
        url = "http://" + url
    return url.removesuffix("/v1") if not url.startswith("unix:") else url


def unix_socket_path(url: str) -> str | None:
    """The socket of a server on --uds given as unix:PATH (relative to the working directory, as serve takes it)
    or unix:///ABSOLUTE-PATH; None for any other URL."""
    if not url.startswith("unix:"):
        return None
    path = url[len("unix:"):]
    return path[2:] if path.startswith("//") else path
