"""`pagedserve serve` as a user starts it: vLLM field commands, API key, bad flags, graceful shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.server.server_utils import free_port, start_server

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
        info, health = (httpx.get(f"{server.url}/{path}").json() for path in ("server_info", "health"))
        assert info["cache"]["num_blocks"] == health["kv_cache"]["num_blocks"] > 0  # both the usable ones
        if "half" in flags:  # float16 on a CPU serves in bfloat16, as vLLM's CPU backend does, and says so
            assert "so the model serves in bfloat16" in server.log()
            assert httpx.get(f"{server.url}/server_info").json()["model"]["dtype"] == "bfloat16"
    finally:
        assert server.stop() == 0, server.log()


def test_api_key_enforced(tiny_model_dir, tmp_path):
    """Any of vLLM's several --api-key values; the flag wins over $VLLM_API_KEY (test_vllm_compat: the variables)."""
    server = start_server(tiny_model_dir("llama"), "--max-model-len", "128", "--api-key", "s3cret", "other",
                          log_dir=tmp_path, env={"VLLM_API_KEY": "from-env"})
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        for key, status in (("other", 200), ("from-env", 401)):
            headers = {"Authorization": f"Bearer {key}"}
            assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == status
        for header, status in (("bearer other", 200), ("BEARER s3cret", 200), ("Basic other", 401), ("other", 401),
                               ("Bearer  other", 200), ("bearer", 401), ("Bearer xother", 401)):  # RFC 9110 11.1
            assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": header}).status_code == status, header
        wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        assert wrong.headers["www-authenticate"] == "Bearer"
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        assert httpx.get(f"{server.url}/version").status_code == 200  # open, as vLLM's (monitoring asks it)
        assert httpx.get(f"{server.url}/server_info").status_code == 401
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="bad", max_retries=0).models.list()
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("flags,word", [
    (["--tensor-parallel-size", "0"], "tensor-parallel-size"),
    (["--device", "tpu"], "--device must be auto, cpu or cuda"),
    (["-tp", "2", "--cpu-binding", "0|1|2"], "--cpu-binding '0|1|2' gives 3 core lists"),
    (["--quantization", "awq"], "quantization"),
    (["--kv-cache-dtype", "fp4"], "kv-cache-dtype"),
    (["--block-size", "7"], "block-size"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--max-n", "0"], "--max-n must be >= 1"),
    (["--fault-injection", "nowhere:x"], "--fault-injection rule"),
    (["--max-model-len", "0"], "--max-model-len must be >= 2"),
    (["--dtype", "nonsense"], "--dtype must be one of auto, bfloat16"),
    # these served a default, or failed with a traceback after loading the model
    (["--num-gpu-blocks-override", "1"], "--num-gpu-blocks-override must be at least 2"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1, got 0"),
    (["--num-threads", "-2"], "--num-threads must be at least 1"),
    (["--max-waiting-requests", "-1"], "--max-waiting-requests must be at least 0"),
    (["--tokenizer", "/nonexistent"], "tokenizer '/nonexistent' is not an existing directory"),
    (["--api-key", ""], "--api-key is empty"),
    (["--ssl-keyfile", __file__, "--ssl-certfile", __file__], "--ssl-certfile"),  # not PEM
])
def test_unsupported_flags_fail_at_start(tiny_model_dir, flags, word):
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", tiny_model_dir("llama"), *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert word in result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_in_use_is_refused_before_the_model_loads(tiny_model_dir):
    """It was uvicorn's own "[Errno 98]" once the model had loaded."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", tiny_model_dir("llama"), "--port",
                                 str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"port {port} is in use" in result.stderr and "--port N" in result.stderr
    assert "loading" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("model,flags,words", [
    ("/nonexistent/model", [], ["unknown model '/nonexistent/model'", "A local path works too"]),
    ("tiny", ["--max-model-len", "513"], ["more than the 512 positions the model was trained for",
                                          "PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1"]),
])
def test_what_loading_finds_wrong_fails_the_start_with_the_fix(tiny_model_dir, model, flags, words):
    """Found once the port is open (resolving the model, reading its config): one line with the fix, exit 1."""
    model = tiny_model_dir("llama") if model == "tiny" else model
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", model, *flags, "--host", "127.0.0.1",
                             "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and all(word in result.stderr for word in words), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_an_unknown_kernel_isa_fails_at_start(tiny_model_dir):
    env = {**os.environ, "PAGEDSERVE_CPU_ISA": "neon"}
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", tiny_model_dir("llama")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "PAGEDSERVE_CPU_ISA='neon' is not one of native, avx2" in result.stderr
    assert "Traceback" not in result.stderr


def test_sigterm_lets_in_flight_request_finish(tiny_model_dir, tmp_path):
    # Passive OpenMP waits: on a box whose cores another process keeps busy, spinning threads can make
    # 400 tokens outlast the 30 s grace period (cli/common.py measured 1.8 tok/s spin vs 6.9 passive).
    server = start_server(tiny_model_dir("llama"), "--max-model-len", "512", "--dtype", "float32",
                          "--omp-wait-policy", "passive", log_dir=tmp_path)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt="go", max_tokens=400, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)  # the request is generating: SIGTERM now lands while it is in flight
    server.process.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert first.choices and rest[-1].usage.completion_tokens == 400
    assert server.process.wait(30) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.url}/health", timeout=2)
    log = server.log()  # the stop's start and end are logged (QA-AF: nothing was, at the default level)
    assert "SIGTERM: stopping; requests in flight get up to 30 s" in log and "stopped (exit code 0)" in log


@pytest.mark.parametrize("grace,second_signal,says", [
    ("2", False, "--shutdown-grace-s (2 s)"),
    ("120", True, "stopped by a second signal"),
], ids=["grace-runs-out", "second-signal"])
def test_requests_outlasting_the_shutdown_grace_get_a_503_body_or_an_error_event(long_context_model, tmp_path, grace,
                                                                                second_signal, says):
    """When --shutdown-grace-s runs out, requests still open get a 503 with an OpenAI error body, and a stream
    an error event and [DONE] (uvicorn's cancellation gave a plain-text 500 and cut the stream). A second signal
    while requests still run (SIGINT after SIGTERM: a Ctrl-C after systemctl stop) ends the grace period there and
    then, the same way: uvicorn's forced exit cut the streams without an event and logged a CancelledError
    traceback per request (QA-T)."""
    server = start_server(long_context_model, "--max-model-len", "8192", "--dtype", "float32",
                          "--shutdown-grace-s", grace, log_dir=tmp_path)
    body = {"prompt": "go", "max_tokens": 8000, "ignore_eos": True}  # many seconds
    replies = {}
    plain = threading.Thread(target=lambda: replies.update(
        plain=httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)))
    plain.start()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # generating
        _wait_running(server, 2)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(0.5)  # still draining: the grace period is 120 s
            assert server.process.poll() is None
            server.process.send_signal(signal.SIGINT)
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    plain.join(30)
    assert server.process.wait(30) == 0
    assert time.monotonic() - started < 10
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and says in error["message"]
    assert replies["plain"].status_code == 503
    assert "shutting down" in replies["plain"].json()["error"]["message"]
    assert "Exception in ASGI application" not in server.log() and "CancelledError" not in server.log()


def _wait_running(server, count: int) -> None:
    from tests.server.test_api import metric_value

    deadline = time.monotonic() + 30  # the plain request in flight too: its thread may connect after this
    while metric_value(server, "vllm:num_requests_running") < count:  # (a refused connection failed the test)
        assert time.monotonic() < deadline, "the plain request never started"
        time.sleep(0.05)


def test_a_client_still_sending_its_body_at_the_grace_s_end_gets_a_503_and_no_traceback(tiny_model_dir, tmp_path):
    """uvicorn cancels a request still waiting for its body when the grace runs out: it logged "Exception in ASGI
    application" with a CancelledError traceback."""
    import socket

    server = start_server(tiny_model_dir("llama"), "--max-model-len", "128", "--shutdown-grace-s", "1",
                          log_dir=tmp_path)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")  # the rest never comes
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        answer = b""
        while chunk := sock.recv(4096):  # headers and body may come apart; the server closes at the end
            answer += chunk
    assert server.process.wait(30) == 0
    assert answer.startswith(b"HTTP/1.1 503") and b"shutting down" in answer, answer
    assert "Exception in ASGI application" not in server.log() and "CancelledError" not in server.log()


def test_full_queue_answers_429_with_retry_after(tiny_model_dir, tmp_path):
    """One request running and one waiting fill a queue of 1 + 1; every request past them gets 429."""
    from tests.server.test_api import metric_value

    server = start_server(tiny_model_dir("llama"), "--max-model-len", "512", "--max-num-seqs", "1",
                          "--max-waiting-requests", "1", "--omp-wait-policy", "passive", log_dir=tmp_path)
    body = {"prompt": "busy", "max_tokens": 500, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=120) as http:
            # Streams, so they stay in the engine until closed here: the queue is full for as long as needed.
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as running, \
                    http.stream("POST", f"{server.url}/v1/completions", json=body) as waiting:
                assert running.status_code == waiting.status_code == 200
                deadline = time.monotonic() + 60
                while (metric_value(server, "vllm:num_requests_running"),
                       metric_value(server, "vllm:num_requests_waiting")) != (1, 1):
                    assert time.monotonic() < deadline, "the two requests never filled the queue"
                    time.sleep(0.05)
                results: list = []
                # streamed ones too: a 429 before the stream's 200 (it was a 200 with an error event in it)
                bodies = [("/v1/completions", {**body, "stream": False})] * 2 + [("/v1/completions", body), (
                    "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})]
                threads = [threading.Thread(target=lambda path=path, b=b: results.append(
                    http.post(f"{server.url}{path}", json=b))) for path, b in bodies]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(120)
            assert sorted(r.status_code for r in results) == [429] * 4
            assert all(r.headers.get("retry-after") for r in results)
            assert all("busy" in r.json()["error"]["message"] for r in results)
            # an expected refusal is answered, not logged as a crash (which also drops the keep-alive connection)
            assert "Exception in ASGI application" not in server.log()
            deadline = time.monotonic() + 30  # the closed streams are aborted; then the queue has room again
            while metric_value(server, "vllm:num_requests_running") + metric_value(
                    server, "vllm:num_requests_waiting") > 0:
                assert time.monotonic() < deadline, "closing the streams did not abort their requests"
                time.sleep(0.05)
            too_many = http.post(f"{server.url}/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 3})
            assert too_many.status_code == 400 and "takes at most 2 at once" in too_many.json()["error"]["message"]
            ok = http.post(f"{server.url}/v1/completions", json={"prompt": "again", "max_tokens": 3})
            assert ok.status_code == 200
    finally:
        assert server.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_gguf_loads_exits_cleanly(sig):
    """SIGTERM/SIGINT in loading_weights (Qwen2.5-Coder's GGUF: ~2 s of dequantization): exit 0. The interpreter
    was finalized under the loader thread's native code: SIGABRT ("terminate called without an active
    exception"), exit 134, 2 times of 2 before."""
    import json
    import urllib.error
    import urllib.request

    from tests.models.real_models import QWEN_CODER, packaged_model

    model, port = str(packaged_model(QWEN_CODER)), free_port()
    process = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", model, "--host", "127.0.0.1", "--port",
                                str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    phase, deadline = None, time.monotonic() + 60
    while phase != "loading_weights" and process.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                phase = json.load(response)["phase"]
        except urllib.error.HTTPError as error:  # 503 while starting, with the phase
            phase = json.loads(error.read())["phase"]
        except OSError:
            pass
        time.sleep(0.02)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=60)
    assert phase == "loading_weights", stderr[-2000:]
    assert process.returncode == 0 and "stopped during start-up (phase loading_weights)" in stderr, stderr[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_the_server_starts_exits_0(sig):
    """Before uvicorn takes the signals over (importing torch: the first second) SIGTERM ended the process with 143
    and SIGINT with a KeyboardInterrupt traceback. Deterministic: the signal arrives right after the handlers are
    installed, in the middle of an import."""
    code = ("import os, signal, sys; from pagedserve.cli.serve import exit_on_signals_until_serving; "
            f"exit_on_signals_until_serving(); os.kill(os.getpid(), {int(sig)}); import torch; sys.exit(3)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_a_connection_without_a_complete_request_head_is_closed(tiny_model_dir, tmp_path):
    """--request-head-timeout-s: a connection that sends nothing, or trickles its headers (slowloris), is closed
    after the deadline (uvicorn held both for ever); a request whose head arrived may send its body slowly, and a
    kept-alive connection's next request has a deadline of its own."""
    import socket

    server = start_server(tiny_model_dir("llama"), "--max-model-len", "128", "--request-head-timeout-s", "1",
                          log_dir=tmp_path)
    port = int(server.url.rsplit(":", 1)[1])

    def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
        """Whether the server closes `sock` within `seconds`, sending `trickle` a byte each 0.2 s meanwhile."""
        deadline = time.monotonic() + seconds
        sock.settimeout(0.2)
        for byte in [trickle[i:i + 1] for i in range(len(trickle))] or [b""] * int(seconds / 0.2 + 1):
            if time.monotonic() > deadline:
                return False
            try:
                if byte:
                    sock.sendall(byte)
                if sock.recv(4096) == b"":
                    return True
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return True
        return False

    def status_line(sock: socket.socket) -> bytes:
        """One whole response read off `sock` (its headers, then Content-Length bytes of body): its status line."""
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(4096)
        head, body = data.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += sock.recv(4096)
        return head.split(b"\r\n", 1)[0]

    try:
        with socket.create_connection(("127.0.0.1", port)) as idle:
            assert closed_within(idle, 4.0)
        with socket.create_connection(("127.0.0.1", port)) as slow:
            assert closed_within(slow, 4.0, b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + b"X-Slow: 1\r\n" * 9)
        body = b'{"prompt": "hi", "max_tokens": 2}'
        with socket.create_connection(("127.0.0.1", port), timeout=30) as upload:
            upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(body))
            for i in range(0, len(body), 4):  # ~1.8 s of body, past the deadline
                time.sleep(0.2)
                upload.sendall(body[i:i + 4])
            assert b" 200 " in status_line(upload)
            time.sleep(0.5)  # kept alive: the next request within its own deadline
            upload.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert b" 200 " in status_line(upload)
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        assert server.stop() == 0, server.log()


def test_a_request_body_that_stalls_or_trickles_gets_a_408_and_its_connection_is_closed(tiny_model_dir, tmp_path):
    """--request-body-timeout-s, as nginx's client_body_timeout: once a request's head was in, nothing timed its
    body, so a body that stopped short of its Content-Length, a chunked body without its last chunk, or one sent at
    a byte a second held its connection for ever (2000 of them took the process's file descriptors). Each now gets
    a 408 with an error body and is closed; meanwhile another connection is served, an upload that keeps sending
    is never cut however long it takes, and a streamed response outlives the timeout."""
    import socket

    server = start_server(tiny_model_dir("llama"), "--max-model-len", "128", "--request-body-timeout-s", "1",
                          log_dir=tmp_path)
    port = int(server.url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    body = b'{"prompt": "hi", "max_tokens": 2}'

    def answer_and_close(sock: socket.socket, within: float, trickle: bytes = b"") -> tuple[bytes, float]:
        """Everything the server sends on `sock` until it closes it (b"" if it does not within `within` s), and
        when it closed it; `trickle` goes out a byte each 0.1 s meanwhile, until a send finds the connection
        closed (the server's kernel resets it: what it answered is still read)."""
        started, data = time.monotonic(), b""
        sock.settimeout(0.1)
        while time.monotonic() - started < within:
            try:
                if trickle:
                    sock.sendall(trickle[:1])
                    trickle = trickle[1:]
            except OSError:
                trickle = b""
            try:
                chunk = sock.recv(4096)
            except socket.timeout:
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return data, time.monotonic() - started
            data += chunk
        return b"", time.monotonic() - started

    def check_408(data: bytes) -> None:
        assert data, "no answer, or the connection stayed open"
        response_head, response_body = data.split(b"\r\n\r\n", 1)
        assert response_head.startswith(b"HTTP/1.1 408 "), data
        assert b"connection: close" in response_head.lower(), data
        error = json.loads(response_body)["error"]
        assert error["code"] == 408 and "--request-body-timeout-s" in error["message"], error

    stalled = socket.create_connection(("127.0.0.1", port))
    chunked = socket.create_connection(("127.0.0.1", port))
    empty = socket.create_connection(("127.0.0.1", port))  # not a byte of its body: "stalled", not "too slowly"
    try:
        stalled.sendall(head + b"Content-Length: 1000\r\n\r\n" + body[:10])
        chunked.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + b"5\r\n" + body[:5] + b"\r\n")
        empty.sendall(head + b"Expect: 100-continue\r\nContent-Length: 50\r\n\r\n")
        served = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert served.status_code == 200, served.text  # another connection, while those wait
        for sock in (stalled, chunked, empty):
            data, seconds = answer_and_close(sock, 5.0)
            check_408(data[data.find(b"HTTP/1.1 4"):])  # after the empty one's 100 Continue
        assert b"the request body stalled" in data, data
        with socket.create_connection(("127.0.0.1", port)) as trickling:  # 10 bytes/s: under the minimum rate
            trickling.sendall(head + b"Content-Length: 1000\r\n\r\n")
            data, seconds = answer_and_close(trickling, 5.0, b" " * 1000)
            check_408(data)
            assert seconds < 4.0
        padded = body + b" " * 3000  # ~1200 bytes/s for 2.5 s, past the timeout: it keeps coming, so it is read
        with socket.create_connection(("127.0.0.1", port), timeout=30) as upload:
            upload.sendall(head + b"Content-Length: %d\r\n\r\n" % len(padded))
            for i in range(0, len(padded), 300):
                time.sleep(0.25)
                upload.sendall(padded[i:i + 300])
            assert upload.recv(4096).startswith(b"HTTP/1.1 200 ")
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 8, "stream": True}) as stream:
            assert stream.status_code == 200
            events = []
            for line in stream.iter_lines():  # read slowly: the response lasts past the timeout
                time.sleep(0.2)
                events.append(line)
            assert "data: [DONE]" in events
        metrics = httpx.get(f"{server.url}/metrics").text  # the 408s are not counted as the app's answer (a 400)
        assert 'status="4xx"' not in metrics and 'status="2xx"' in metrics
    finally:
        stalled.close()
        chunked.close()
        empty.close()
        assert server.stop() == 0, server.log()
