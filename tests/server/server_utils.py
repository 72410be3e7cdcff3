"""Start a real `pagedserve serve` process on 127.0.0.1 and a free port; stopped by the test."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    health_statuses: list[tuple[int, str]] = field(default_factory=list)  # (status, phase) seen while starting
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


def openai_client(server: ServerProcess, api_key: str = "unused", **kwargs):
    """The official openai client pointed at a test server (no retries: a failure must show)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, **kwargs)


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """What httpx verifies a server with: the default CAs, or this file's."""
    return ssl.create_default_context(cafile=ca_file)


def start_server(model: str, *flags: str, log_dir: Path, env: dict | None = None,
                 ready_timeout: float = 120.0, wait_for_ready: bool = True, ca_file: str | None = None
                 ) -> ServerProcess:
    """The server once /health says ready (200), or, with wait_for_ready=False, once its port answers.
    `ca_file`: the server serves https (its flags give --ssl-keyfile/--ssl-certfile), verified with this file."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    command = [sys.executable, "-m", "pagedserve", "serve", model, "--host", "127.0.0.1", "--port", str(port),
               *flags]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(process, port, log_path, scheme="https" if ca_file else "http")
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            response = httpx.get(f"{server.url}/health", timeout=2.0, verify=tls_context(ca_file))
            phase = _phase(response)
            if not server.health_statuses or server.health_statuses[-1] != (response.status_code, phase):
                server.health_statuses.append((response.status_code, phase))
            if response.status_code == 200 or not wait_for_ready:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"server not ready after {ready_timeout} s:\n{server.log()}")


def _phase(response: httpx.Response) -> str:
    """/health's phase; "" for a body that is not ours (Ray Serve's proxy answers 404 text before the app is up)."""
    try:
        return response.json().get("phase", "") if response.content else ""
    except ValueError:
        return ""


def module_server(model: str, *flags: str, tmp_path_factory, **kwargs):
    """For a module-scoped fixture: `yield from module_server(...)` starts a server, yields it, and at the end
    checks it stopped cleanly (exit 0) and never handled a client's error as a crash."""
    server = start_server(model, *flags, log_dir=tmp_path_factory.mktemp("logs"), **kwargs)
    yield server
    code = server.stop()
    assert code == 0, f"exit {code}:\n{server.log()}"
    assert "Exception in ASGI application" not in server.log(), "a client error was handled as a crash"
