"""--uds (vLLM's): the server listens on a Unix domain socket instead of TCP, refuses a path it cannot use, and
removes its socket file when it stops."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.server_utils import free_port


def serve(model: str, *flags: str, log_path, umask: int | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagedserve", "serve", model, "--max-model-len", "128", "--dtype", "float32",
               *flags]
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, umask=-1 if umask is None else umask,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})


def wait_ready(process: subprocess.Popen, client: httpx.Client, log_path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text()
        try:
            if client.get("http://localhost/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"not ready:\n{log_path.read_text()}")


def test_serves_on_a_unix_socket_and_removes_it(tiny_model_dir, tmp_path):
    path = tmp_path / "ps.sock"
    port = free_port()
    log_path = tmp_path / "server.log"
    process = serve(tiny_model_dir("llama"), "--uds", str(path), "--port", str(port), log_path=log_path, umask=0o077)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as client:
            wait_ready(process, client, log_path)
            assert path.stat().st_mode & 0o777 == 0o600  # the umask's (uvicorn made it 0666 whatever the umask)
            reply = client.post("http://localhost/v1/completions", json={"prompt": "Hello", "max_tokens": 3,
                                                                        "temperature": 0, "ignore_eos": True},
                                timeout=60)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
            # A second server on the same socket is refused before it loads anything (it would take the path).
            second = subprocess.run([sys.executable, "-m", "pagedserve", "serve", tiny_model_dir("llama"), "--uds",
                                     str(path)], capture_output=True, text=True, timeout=120)
            assert second.returncode != 0 and "another server is listening" in second.stderr, second.stderr
            assert client.get("http://localhost/health").status_code == 200
        with socket.socket() as tcp:  # --host/--port are ignored
            assert tcp.connect_ex(("127.0.0.1", port)) != 0
        assert f"on unix:{path}" in log_path.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log_path.read_text()
    assert not path.exists()


@pytest.mark.parametrize("make,words", [
    (lambda d: str(d / "missing" / "ps.sock"), ["does not exist"]),
    (lambda d: (d / "file.txt").write_text("x") and str(d / "file.txt"), ["not a socket"]),
    (lambda d: str(d / ("x" * 120)), ["at most 107"]),
])
def test_unusable_socket_paths_are_refused(tmp_path, make, words):
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--uds", make(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "--uds" in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_bench_and_watch_reach_a_unix_socket_server(tiny_model_dir, tmp_path):
    """unix:PATH as --base-url (bench serve) and --url (watch): watch called a healthy --uds server DOWN."""
    path = tmp_path / "ps.sock"
    log_path = tmp_path / "server.log"
    process = serve(tiny_model_dir("llama"), "--uds", str(path), log_path=log_path)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as client:
            wait_ready(process, client, log_path)
        bench = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "serve", "--base-url", f"unix:{path}",
                                "--num-prompts", "2", "--input-len", "8", "--output-len", "4"],
                               capture_output=True, text=True, timeout=120)
        assert bench.returncode == 0, bench.stderr
        watch = subprocess.run([sys.executable, "-m", "pagedserve", "watch", "--pid", str(process.pid), "--url",
                                f"unix://{path}", "--interval", "0.1", "--count", "2"],
                               capture_output=True, text=True, timeout=60)
        assert watch.returncode == 0 and "unreachable" not in watch.stdout, watch.stdout
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log_path.read_text()
