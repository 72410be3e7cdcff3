"""`bench startup`: launch a server, time each start-up phase, the first request and steady ones.

The server runs as a child in its own session (process group). Its process tree is sampled with
psutil for peak RSS (the sum of the RSS of every process: shared pages count once per process, so
this is an upper bound), and at the end the whole group gets SIGTERM, then SIGKILL after a grace
period; every process ever seen in the tree is then checked to be gone (zombies count as gone).
The child's environment carries a marker (`TREE_MARKER`), inherited by every descendant, so a
process that left the group (setsid) and lost its parent before a sample is still found.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from pagedserve.benchmarks.client import COMPLETIONS, build_request_body, send_request
from pagedserve.benchmarks.metrics import RequestRecord

# Environment variable set on the server child (never read as configuration): its value tags the tree.
TREE_MARKER = "PAGEDSERVE_BENCH_STARTUP_TREE"


@dataclass(frozen=True)
class StartupBenchConfig:
    """Everything `bench startup` needs; the CLI builds it from flags."""

    model: str | None = None
    server_cmd: str | None = None  # None: `python -m pagedserve serve MODEL`; may use {port} {host} {model}
    serve_args: tuple[str, ...] = ()  # appended to the server command
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    ready_timeout: float = 1800.0
    num_steady_requests: int = 5
    prompt: str = "Hello, my name is"
    max_tokens: int = 16
    ignore_eos: bool = False
    endpoint: str = COMPLETIONS
    grace_period: float = 10.0  # seconds between SIGTERM and SIGKILL
    poll_interval: float = 0.1
    rss_sample_interval: float = 0.1
    request_timeout: float = 3600.0
    log_path: str | None = None  # None: a temporary file, reported
    api_key: str | None = None


@dataclass
class PhaseObservation:
    """A start-up phase seen in a /health 503 body; times in seconds since launch (poll resolution)."""

    phase: str
    first_seen: float
    last_seen: float
    last_progress: float | None = None
    duration: float | None = None  # until the next phase (or readiness) was first seen


@dataclass
class ServerPhase:
    """A start-up phase as the server itself recorded it (the `phases` list of its /health body)."""

    name: str
    started_at_s: float  # seconds after the server's process start, by the server's clock
    duration_s: float | None


@dataclass
class ShutdownReport:
    signal_used: str  # "SIGTERM", "SIGKILL", or "none" when the group had already exited
    shutdown_seconds: float
    num_processes_seen: int
    leftover_pids: list[int]


@dataclass
class StartupResult:
    command: list[str]
    port: int
    log_path: str
    time_to_port_open: float | None = None
    time_to_ready: float | None = None
    phases: list[PhaseObservation] = field(default_factory=list)  # seen by polling: short phases may be missed
    server_phases: list[ServerPhase] = field(default_factory=list)  # every phase, from the server's own record
    server_ready_elapsed_s: float | None = None  # the server's own "elapsed_s" when it first answered 200
    health_status_codes: dict[int, int] = field(default_factory=dict)
    model: str | None = None
    first_request: RequestRecord | None = None
    steady_requests: list[RequestRecord] = field(default_factory=list)
    steady_median_e2e: float | None = None
    steady_median_ttft: float | None = None
    cold_steady_ratio: float | None = None
    peak_rss_bytes: int = 0
    shutdown: ShutdownReport | None = None
    child_exit_code: int | None = None
    error: str | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def build_command(config: StartupBenchConfig, port: int) -> list[str]:
    """The server command line: `--server-cmd` with placeholders filled, or pagedserve's own."""
    if config.server_cmd:
        text = config.server_cmd.replace("{model}", shlex.quote(config.model or ""))
        has_port = "{port}" in text
        text = text.replace("{port}", str(port)).replace("{host}", config.host)
        command = shlex.split(text)
        if not has_port:
            command += ["--host", config.host, "--port", str(port)]
    else:
        if not config.model:
            raise ValueError("bench startup needs a MODEL (or --server-cmd)")
        command = [sys.executable, "-m", "pagedserve", "serve", config.model]
        command += ["--host", config.host, "--port", str(port)]
    return command + list(config.serve_args)


class TreeWatcher:
    """Samples a process tree in a thread: peak summed RSS and every (pid, create_time) seen."""

    def __init__(self, root_pid: int, interval: float) -> None:
        self.root_pid = root_pid
        self.interval = interval
        self.peak_rss_bytes = 0
        self.seen: dict[int, float] = {}  # pid -> create_time, to tell a reused pid apart
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="bench-rss", daemon=True)
        self.sample()  # record the root's create_time at once, before its pid could be reused

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0
        with self._lock:
            for process in processes:
                try:
                    self.seen.setdefault(process.pid, process.create_time())
                    total += process.memory_info().rss
                except psutil.Error:
                    continue
            self.peak_rss_bytes = max(self.peak_rss_bytes, total)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


def _is_alive(pid: int, create_time: float) -> bool:
    """True if `pid` still runs (not a zombie) and was created at `create_time` (not a reused pid)."""
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - create_time) > 0.01:
            return False  # the pid was reused by an unrelated process
        if process.status() != psutil.STATUS_ZOMBIE:
            return True
        # A zombie leader whose other threads still run is a process still exiting (seen for ~0.1 s
        # after a Python server's main thread returns): not gone yet.
        return process.num_threads() > 1
    except psutil.Error:
        return False


def _find_members(pgid: int, marker: str) -> dict[int, float]:
    """Processes in group `pgid` or carrying `marker` in their environment (pid -> create_time)."""
    members: dict[int, float] = {}
    for process in psutil.process_iter(["pid"]):
        try:
            in_group = os.getpgid(process.pid) == pgid
            if in_group or process.environ().get(TREE_MARKER) == marker:
                members[process.pid] = process.create_time()
        except (OSError, psutil.Error):  # gone meanwhile, or another user's process
            continue
    return members


def _survivors(tracked: dict[int, float], pgid: int, marker: str) -> list[int]:
    tracked.update(_find_members(pgid, marker))
    return sorted(pid for pid, created in tracked.items() if _is_alive(pid, created))


def _wait_gone(
    process: subprocess.Popen[bytes], tracked: dict[int, float], pgid: int, marker: str, timeout: float
) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        process.poll()  # reap our direct child so it does not linger as a zombie
        alive = _survivors(tracked, pgid, marker)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def stop_process_tree(
    process: subprocess.Popen[bytes], watcher: TreeWatcher, marker: str, grace_period: float
) -> ShutdownReport:
    """SIGTERM the child's process group, SIGKILL after `grace_period`, then list what is left."""
    watcher.stop()
    tracked: dict[int, float] = dict(watcher.seen)
    pgid = process.pid  # start_new_session=True: the child leads its own group
    start = time.perf_counter()
    signal_used = "none"
    if _survivors(tracked, pgid, marker):
        signal_used = "SIGTERM"
        _signal_all(pgid, tracked, signal.SIGTERM)
        if _wait_gone(process, tracked, pgid, marker, grace_period):
            signal_used = "SIGKILL"
            _signal_all(pgid, tracked, signal.SIGKILL)
    left = _wait_gone(process, tracked, pgid, marker, 5.0)
    if not left:
        try:
            process.wait(timeout=5.0)  # collect the exit code of our direct child
        except subprocess.TimeoutExpired:
            left = sorted({*left, process.pid})
    return ShutdownReport(
        signal_used=signal_used,
        shutdown_seconds=time.perf_counter() - start,
        num_processes_seen=len(tracked),
        leftover_pids=left,
    )


def _signal_all(pgid: int, tracked: dict[int, float], signum: int) -> None:
    """Signal the group, and every tracked process that left it (setsid) individually."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
    for pid, created in tracked.items():
        if _is_alive(pid, created):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                continue


def _log_tail(path: str, num_lines: int = 20) -> str:
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


def _exited_error(process: subprocess.Popen[bytes], log_path: str, when: str) -> RuntimeError:
    return RuntimeError(
        f"server exited with code {process.returncode} {when}; last lines of {log_path}:\n{_log_tail(log_path)}"
    )


async def _wait_port(
    config: StartupBenchConfig, port: int, process: subprocess.Popen[bytes], log_path: str, deadline: float
) -> None:
    """Return once the port accepts a TCP connection; raise if the server dies or time runs out."""
    while True:
        if process.poll() is not None:
            raise _exited_error(process, log_path, "before opening its port")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(config.host, port), timeout=1.0)
        except (OSError, asyncio.TimeoutError):
            if time.perf_counter() >= deadline:
                raise TimeoutError(f"port {port} not open after {config.ready_timeout:.0f} s") from None
            await asyncio.sleep(config.poll_interval)
            continue
        writer.close()
        return


def _observe_phase(result: StartupResult, body: Any, now: float) -> None:
    """Record the phase named by a /health body such as {"status": "starting", "phase": ..., "progress": ...}."""
    if not isinstance(body, dict):
        return
    phase = body.get("phase") or body.get("status")
    if not isinstance(phase, str):
        return
    progress = body.get("progress")
    progress = float(progress) if isinstance(progress, (int, float)) else None
    last = result.phases[-1] if result.phases else None
    if last is not None and last.phase == phase:
        last.last_seen, last.last_progress = now, progress
    else:
        result.phases.append(PhaseObservation(phase=phase, first_seen=now, last_seen=now, last_progress=progress))


def _record_server_phases(result: StartupResult, response: httpx.Response) -> None:
    """Keep the server's own phase list (pagedserve: {"phases": [{"name", "started_at_s", "duration_s"}]})."""
    try:
        body = response.json()
    except ValueError:
        return
    if not isinstance(body, dict):
        return
    if isinstance(body.get("elapsed_s"), (int, float)):
        result.server_ready_elapsed_s = float(body["elapsed_s"])
    phases = body.get("phases")
    if not isinstance(phases, list):
        return
    result.server_phases = [
        ServerPhase(name=str(entry["name"]), started_at_s=float(entry.get("started_at_s") or 0.0),
                    duration_s=entry.get("duration_s"))
        for entry in phases
        if isinstance(entry, dict) and "name" in entry
    ]


def _check_health_body(result: StartupResult, response: httpx.Response, now: float) -> None:
    """Record the phase of a not-ready /health answer; raise if it says start-up failed."""
    try:
        body = response.json()
    except ValueError:
        return
    _observe_phase(result, body, now)
    if isinstance(body, dict) and body.get("status") in ("error", "failed"):
        raise RuntimeError(f"server reported a failed start-up on /health: {body}")


async def _wait_ready(
    client: httpx.AsyncClient,
    config: StartupBenchConfig,
    process: subprocess.Popen[bytes],
    result: StartupResult,
    launch: float,
    deadline: float,
) -> None:
    """Poll /health until 200, recording the phases of 503 bodies (/v1/models if there is no /health)."""
    path = "/health"
    while True:
        if process.poll() is not None:
            raise _exited_error(process, result.log_path, "before it was ready")
        try:
            response = await client.get(path, timeout=5.0)
        except httpx.HTTPError:
            response = None
        now = time.perf_counter() - launch
        if response is not None:
            result.health_status_codes[response.status_code] = (
                result.health_status_codes.get(response.status_code, 0) + 1
            )
            if response.status_code == 200:
                result.time_to_ready = now
                _record_server_phases(result, response)
                return
            if response.status_code == 404 and path == "/health":
                path = "/v1/models"  # a server without /health: ready when it lists its models
            else:
                _check_health_body(result, response, now)
        if time.perf_counter() >= deadline:
            raise TimeoutError(f"server not ready after {config.ready_timeout:.0f} s")
        await asyncio.sleep(config.poll_interval)


def _close_phases(result: StartupResult) -> None:
    """Each phase lasts until the next one (or readiness) was first seen."""
    for index, phase in enumerate(result.phases):
        following = result.phases[index + 1].first_seen if index + 1 < len(result.phases) else result.time_to_ready
        phase.duration = None if following is None else following - phase.first_seen


async def _model_name(client: httpx.AsyncClient, fallback: str | None) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        if fallback:
            return fallback
        raise RuntimeError("could not read a model id from GET /v1/models and no MODEL was given") from None


async def _time_requests(client: httpx.AsyncClient, config: StartupBenchConfig, result: StartupResult) -> None:
    """The first request, then `num_steady_requests` more one at a time (prompts differ early: no prefix hit)."""
    model = result.model or ""
    records = []
    for index in range(1 + config.num_steady_requests):
        prompt = f"Request {index + 1}. {config.prompt}"
        body = build_request_body(config.endpoint, model, prompt, config.max_tokens, config.ignore_eos)
        record = await send_request(
            client, config.endpoint, body, RequestRecord(request_id=index, is_warmup=index == 0), config.endpoint
        )
        if not record.success:
            raise RuntimeError(f"request {index + 1} failed: {record.error}")
        records.append(record)
    result.first_request, result.steady_requests = records[0], records[1:]
    if result.steady_requests:
        result.steady_median_e2e = statistics.median(r.e2e_latency for r in result.steady_requests)
        ttfts = [r.ttft for r in result.steady_requests if r.ttft is not None]
        result.steady_median_ttft = statistics.median(ttfts) if ttfts else None
        if result.steady_median_e2e > 0:
            result.cold_steady_ratio = result.first_request.e2e_latency / result.steady_median_e2e


async def _run_phases(
    config: StartupBenchConfig, process: subprocess.Popen[bytes], result: StartupResult, launch: float
) -> None:
    deadline = launch + config.ready_timeout
    await _wait_port(config, result.port, process, result.log_path, deadline)
    result.time_to_port_open = time.perf_counter() - launch
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.request_timeout, connect=30.0)
    base_url = f"http://{config.host}:{result.port}"
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, trust_env=False) as client:
        try:
            await _wait_ready(client, config, process, result, launch, deadline)
        finally:
            _close_phases(result)
        result.model = await _model_name(client, config.model)
        await _time_requests(client, config, result)


def run_startup_bench(config: StartupBenchConfig) -> StartupResult:
    """Launch the server, measure start-up and first/steady requests, then stop its whole process tree."""
    port = config.port or free_port(config.host)
    command = build_command(config, port)
    log_path = config.log_path
    if log_path is None:
        handle, log_path = tempfile.mkstemp(prefix="pagedserve-bench-startup-", suffix=".log")
        os.close(handle)
    result = StartupResult(command=command, port=port, log_path=log_path)
    marker = uuid.uuid4().hex
    environment = {**os.environ, TREE_MARKER: marker}
    with open(log_path, "wb") as log:
        launch = time.perf_counter()
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=environment,
            start_new_session=True,
        )
    watcher = TreeWatcher(process.pid, config.rss_sample_interval)
    watcher.start()
    try:
        asyncio.run(_run_phases(config, process, result, launch))
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        result.error = str(exc)
    finally:
        result.shutdown = stop_process_tree(process, watcher, marker, config.grace_period)
        result.peak_rss_bytes = watcher.peak_rss_bytes
        result.child_exit_code = process.poll()
    return result
