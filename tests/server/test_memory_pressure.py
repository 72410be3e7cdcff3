"""Giving way under memory pressure, as a client sees it (#19 item 4): the server reads a simulated MemAvailable
(a meminfo file the test rewrites; cgroups cannot be created here). While short: new requests get 503 with
Retry-After and an OpenAI-style body, the request already running finishes, the free KV blocks' pages are
released, /health and the log say memory_pressure; when memory returns, serving resumes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from tests.server.server_utils import ServerProcess, start_server

GIB = 1 << 30
NUM_STREAMED = 1000


def write_meminfo(path: Path, available: int) -> None:
    path.write_text(f"MemTotal: {24 * GIB // 1024} kB\nMemFree: {available // 1024} kB\n"
                    f"MemAvailable: {available // 1024} kB\n")


def wait_for(server: ServerProcess, predicate, what: str, timeout: float = 60.0) -> dict:
    """Poll /health until predicate(body); the bound is a deadlock guard, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(f"{server.url}/health", timeout=5).json()
        if predicate(body):
            return body
        time.sleep(0.1)
    raise AssertionError(f"{what} not seen in /health within {timeout} s (last memory: {body.get('memory')}):\n{server.log()}")


def completion(server: ServerProcess, prompt: str, max_tokens: int = 8) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def stream_tokens(server: ServerProcess, received: list[str], done: threading.Event) -> None:
    body = {"prompt": "a long answer", "max_tokens": NUM_STREAMED, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                received.append(json.loads(line[6:])["choices"][0]["text"])
    done.set()


def test_server_gives_way_under_memory_pressure_and_resumes(tiny_model_dir, tmp_path):
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, 16 * GIB)
    model = tiny_model_dir("llama", max_position_embeddings=4096)
    server = start_server(model, "--max-model-len", "4096", "--memory-pressure-meminfo",
                          str(meminfo), log_dir=tmp_path)
    try:
        # A long prompt leaves more free (cached) blocks behind than the streamed request below ever holds, so
        # that once they are given back the count is lower whenever the pressure is seen
        warm = completion(server, "warm " * 300)
        assert warm.status_code == 200
        warm_blocks = -(-(warm.json()["usage"]["total_tokens"]) // 16)
        assert warm_blocks > -(-(NUM_STREAMED + 16) // 16)
        # the reading the engine takes going idle after it (the one from start-up may still be on /health)
        before = wait_for(server, lambda b: b.get("memory", {}).get("kv_blocks_written", 0) >= warm_blocks,
                          "an RSS reading after the request")["memory"]["kv_blocks_written"]
        received: list[str] = []
        done = threading.Event()
        streamer = threading.Thread(target=stream_tokens, args=(server, received, done))
        streamer.start()
        while not received:
            time.sleep(0.01)
        write_meminfo(meminfo, 100 << 20)  # a neighbour grew: 100 MiB left
        pressed = wait_for(server, lambda b: b["memory_pressure"]["active"], "memory_pressure")
        assert pressed["status"] == "ready" and pressed["memory_pressure"]["available_bytes"] == 100 << 20
        assert not done.is_set(), "the streamed request ended before the pressure began"
        refused = completion(server, "a new request")
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        error = refused.json()["error"]
        assert error["code"] == "memory_pressure" and error["type"] == "ServiceUnavailableError"
        # The warm-up's and the first request's free blocks gave their pages back.
        wait_for(server, lambda b: b["memory"]["kv_blocks_written"] < before, "released KV blocks")
        streamer.join(300)
        assert done.is_set() and len(received) == NUM_STREAMED  # admitted: finished in full
        write_meminfo(meminfo, 16 * GIB)
        wait_for(server, lambda b: not b["memory_pressure"]["active"], "the end of memory_pressure")
        assert completion(server, "after the pressure").status_code == 200
        log = server.log()
        assert "memory_pressure: 100 MiB available" in log and "memory_pressure over" in log
    finally:
        assert server.stop() == 0, server.log()
