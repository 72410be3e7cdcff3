"""`pagedserve serve` as a user starts it: vLLM field commands, API key, bad flags, graceful shutdown."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.server.server_utils import start_server

CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def long_context_model(tiny_model_dir):
    """A tiny model whose config allows 8192 positions, as the field commands ask for."""
    return tiny_model_dir("qwen2", max_position_embeddings=8192)


FIELD_COMMANDS = [
    ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4", "--enforce-eager"],
    ["--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.85", "--max-model-len", "8192",
     "--block-size", "16", "--max-num-batched-tokens", "8192", "--max-num-seqs", "256", "--dtype", "half"],
]


@pytest.mark.parametrize("flags", FIELD_COMMANDS, ids=["float32-eager", "half-8k-256seqs"])
def test_field_commands_start_and_chat(long_context_model, tmp_path, flags):
    server = start_server(long_context_model, *flags, log_dir=tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0]
        assert model.id == long_context_model
        assert model.model_extra["max_model_len"] == int(flags[flags.index("--max-model-len") + 1])
        reply = client.chat.completions.create(model=model.id, messages=CHAT, max_tokens=8)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1
    finally:
        assert server.stop() == 0, server.log()


def test_api_key_enforced(tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir("llama"), "--max-model-len", "128", log_dir=tmp_path,
                          env={"PAGEDSERVE_API_KEY": "s3cret"})
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=client.models.list().data[0].id, prompt="hi",
                                         max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="bad", max_retries=0).models.list()
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("flags,word", [
    (["--tensor-parallel-size", "2"], "tensor-parallel-size"),
    (["--quantization", "awq"], "quantization"),
    (["--kv-cache-dtype", "fp4"], "kv-cache-dtype"),
    (["--block-size", "7"], "block-size"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_unsupported_flags_fail_at_start(tiny_model_dir, flags, word):
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", tiny_model_dir("llama"), *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert word in result.stderr
    assert "Traceback" not in result.stderr


def test_sigterm_lets_in_flight_request_finish(tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir("llama"), "--max-model-len", "512", "--dtype", "float32",
                          log_dir=tmp_path)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    result: dict = {}

    def long_request() -> None:
        result["reply"] = client.completions.create(model=model, prompt="go", max_tokens=400,
                                                    extra_body={"ignore_eos": True})

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.5)  # the request is generating
    server.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert result["reply"].usage.completion_tokens == 400
    assert server.process.wait(30) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.url}/health", timeout=2)


def test_full_queue_answers_429_with_retry_after(tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir("llama"), "--max-model-len", "512", "--max-num-seqs", "1",
                          "--max-waiting-requests", "1", log_dir=tmp_path)
    body = {"prompt": "busy", "max_tokens": 120, "ignore_eos": True}
    try:
        with httpx.Client(timeout=120) as http:
            results: list = []

            def send() -> None:
                results.append(http.post(f"{server.url}/v1/completions", json=body))

            threads = [threading.Thread(target=send) for _ in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            statuses = sorted(r.status_code for r in results)
            assert statuses.count(200) == 2, statuses  # one running + one waiting
            rejected = [r for r in results if r.status_code == 429]
            assert len(rejected) == 4
            assert all(r.headers.get("retry-after") for r in rejected)
            assert all("busy" in r.json()["error"]["message"] for r in rejected)
            # an expected refusal is answered, not logged as a crash (which also drops the keep-alive connection)
            assert "Exception in ASGI application" not in server.log()
            ok = http.post(f"{server.url}/v1/completions", json={"prompt": "again", "max_tokens": 3})
            assert ok.status_code == 200
    finally:
        assert server.stop() == 0
