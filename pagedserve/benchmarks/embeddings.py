"""`bench serve --endpoint /v1/embeddings`: one non-streamed embeddings request, timed into a `RequestRecord`.

An embedding has no tokens to stream, so a record has no TTFT, TPOT or ITL: what counts is the request
latency (E2E, its percentiles) and requests/s, both summarized by the same code as for completions.
Input tokens come from the server's `usage.prompt_tokens`. The response is checked, not just timed: one
vector per input, each a non-empty base64 float32 string (the format the openai client asks for).
"""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx

from pagedserve.benchmarks.metrics import RequestRecord

EMBEDDINGS = "/v1/embeddings"


def build_embedding_body(model: str, prompt: str | list[int]) -> dict[str, Any]:
    """One input (text or token ids) per request, base64 vectors as the openai client asks for them."""
    return {"model": model, "input": prompt, "encoding_format": "base64"}


def _check_embeddings(payload: dict[str, Any], num_inputs: int) -> str:
    """'' when the body holds one non-empty float32 vector per input, else what is wrong."""
    data = payload.get("data")
    if not isinstance(data, list) or len(data) != num_inputs:
        return f"expected {num_inputs} embedding(s), got {len(data) if isinstance(data, list) else 'none'}"
    for item in data:
        raw = base64.b64decode(item.get("embedding") or "")
        if not raw or len(raw) % 4:
            return "an embedding is empty or not float32"
    return ""


async def send_embedding_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                                 record: RequestRecord) -> RequestRecord:
    """POST one embeddings request and fill `record` (latency, prompt tokens, outcome). Never raises."""
    num_inputs = 1 if isinstance(body["input"], str) or not body["input"] or isinstance(body["input"][0], int) \
        else len(body["input"])
    record.output_tokens = 0
    record.send_time = time.perf_counter()
    try:
        response = await client.post(url, json=body)
        record.end_time = time.perf_counter()
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {response.text[:300]}"
            return record
        payload = response.json()
        record.error = _check_embeddings(payload, num_inputs)
        record.prompt_tokens = (payload.get("usage") or {}).get("prompt_tokens")
        record.usage_missing = record.prompt_tokens is None
        record.success = not record.error
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body that is not JSON / not base64
        record.end_time = time.perf_counter()
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return record
