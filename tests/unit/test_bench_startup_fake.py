"""`bench startup` against a fake server script launched through --server-cmd.

The fake (stdlib only) sleeps, opens its port, answers /health 503 with start-up phases and then
200, streams completions with usage, and may spawn children (one in its process group, one that
escaped with setsid) or ignore SIGTERM. Every process must be gone after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

from pagedserve.benchmarks.startup import StartupBenchConfig, run_startup_bench
from pagedserve.cli import bench

FAKE_SERVER = textwrap.dedent("""
    import argparse, json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--pid-file")
    parser.add_argument("--spawn-children", action="store_true")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--crash", action="store_true")
    args = parser.parse_args()
    pids = [os.getpid()]
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.spawn_children:
        sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
        pids.append(subprocess.Popen(sleeper).pid)
        pids.append(subprocess.Popen(sleeper, start_new_session=True).pid)
    with open(args.pid_file, "w") as handle:
        handle.write(json.dumps(pids))
    if args.crash:
        print("fake: cannot load weights", flush=True)
        sys.exit(3)
    ballast = bytearray(30 * 2**20)  # resident memory the RSS sampler should see
    for index in range(0, len(ballast), 4096):
        ballast[index] = 1
    time.sleep(0.3)
    opened = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *unused):
            pass

        def send_json(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            elapsed = time.monotonic() - opened
            if self.path == "/health":
                if elapsed < 0.5:
                    self.send_json(503, {"status": "starting", "phase": "loading_weights", "progress": elapsed / 0.5})
                elif elapsed < 0.9:
                    self.send_json(503, {"status": "starting", "phase": "warming_up"})
                else:
                    self.send_json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [{"id": "fake-model"}]})
            else:
                self.send_json(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for index in range(body["max_tokens"]):
                time.sleep(0.002)
                chunk = {"choices": [{"index": 0, "text": f" w{index}", "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
                self.wfile.flush()
            usage = {"prompt_tokens": 4, "completion_tokens": body["max_tokens"]}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\\n\\n".encode())
            self.wfile.write(b"data: [DONE]\\n\\n")

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    """)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def fake_server(tmp_path: Path) -> Any:
    """(script path, pid file); kills whatever the fake left if the code under test did not."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    pid_file = tmp_path / "pids.json"
    yield script, pid_file
    if pid_file.exists():
        for pid in json.loads(pid_file.read_text()):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _pids(pid_file: Path) -> list[int]:
    return json.loads(pid_file.read_text())


def test_cli_reports_phases_requests_rss_and_leaves_nothing(fake_server: Any, tmp_path: Path, capsys: Any) -> None:
    script, pid_file = fake_server
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    out = tmp_path / "startup.json"
    server_cmd = f"{sys.executable} {script} --pid-file {pid_file} --spawn-children"
    args = parser.parse_args(
        [
            "bench",
            "startup",
            "--server-cmd",
            server_cmd,
            "--max-tokens",
            "4",
            "--grace-period",
            "3",
            "--json",
            str(out),
            "--log-file",
            str(tmp_path / "server.log"),
        ]
    )
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "loading_weights" in table and "warming_up" in table and "Cold / steady latency" in table
    payload = json.loads(out.read_text())
    assert payload["error"] is None
    assert [phase["phase"] for phase in payload["phases"]] == ["loading_weights", "warming_up"]
    assert all(phase["duration"] > 0 for phase in payload["phases"])
    assert payload["phases"][0]["last_progress"] is not None
    assert 0 < payload["time_to_port_open"] <= payload["time_to_ready"]
    assert payload["health_status_codes"]["503"] >= 2 and payload["health_status_codes"]["200"] == 1
    assert payload["model"] == "fake-model"
    assert payload["first_request"]["output_tokens"] == 4 and payload["first_request"]["usage_mismatch"] is False
    assert len(payload["steady_requests"]) == 5 and payload["steady_median_e2e"] > 0
    assert payload["cold_steady_ratio"] > 0
    assert payload["peak_rss_bytes"] > 30 * 2**20
    shutdown = payload["shutdown"]
    assert shutdown["signal_used"] == "SIGTERM" and shutdown["leftover_pids"] == []
    assert shutdown["num_processes_seen"] >= 3
    pids = _pids(pid_file)
    assert len(pids) == 3 and not any(_alive(pid) for pid in pids)  # the setsid child included


def test_server_ignoring_sigterm_is_killed(fake_server: Any) -> None:
    script, pid_file = fake_server
    config = StartupBenchConfig(
        server_cmd=f"{sys.executable} {script} --pid-file {pid_file} --ignore-term",
        num_steady_requests=1,
        max_tokens=2,
        grace_period=0.5,
        log_path=str(pid_file.with_name("server.log")),
    )
    result = run_startup_bench(config)
    assert result.error is None
    assert result.shutdown.signal_used == "SIGKILL" and result.shutdown.leftover_pids == []
    assert not any(_alive(pid) for pid in _pids(pid_file))


def test_server_that_exits_early_is_reported_with_its_log(fake_server: Any) -> None:
    script, pid_file = fake_server
    result = run_startup_bench(
        StartupBenchConfig(
            server_cmd=f"{sys.executable} {script} --pid-file {pid_file} --crash --spawn-children",
            log_path=str(pid_file.with_name("server.log")),
        )
    )
    assert result.error is not None and "code 3" in result.error and "cannot load weights" in result.error
    assert result.time_to_port_open is None and result.first_request is None
    assert result.shutdown.leftover_pids == []
    assert not any(_alive(pid) for pid in _pids(pid_file))


def test_default_command_is_pagedserve_serve_with_flags_after_double_dash() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "startup", "some/model", "--port", "8123", "--", "--max-model-len", "512"])
    config = bench.startup_config_from_args(args)
    from pagedserve.benchmarks.startup import build_command

    assert build_command(config, 8123) == [
        sys.executable,
        "-m",
        "pagedserve",
        "serve",
        "some/model",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--max-model-len",
        "512",
    ]
    vllm = StartupBenchConfig(model="m", server_cmd="vllm serve {model} --port {port}")
    assert build_command(vllm, 9000) == ["vllm", "serve", "m", "--port", "9000"]


def test_own_flags_after_model_reach_the_run_not_only_the_config() -> None:
    """`bench startup MODEL --json F` must write F: flags after MODEL were once parsed only into the config."""
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "startup", "m", "--json", "out.json", "--max-tokens", "3", "--", "--x"])
    merged, model, serve_args = bench._merge_startup_args(args)
    assert (merged.json_path, merged.max_tokens, model, serve_args) == ("out.json", 3, "m", ["--x"])
