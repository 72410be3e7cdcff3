"""Faults injected into a real server's engine (--fault-injection, test-only): a fault in one request fails
that request with a 500 naming it, its KV blocks are freed, and the server goes on serving; a model step that
fails again on the retry ends the engine: 503 to everyone and a non-zero exit."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from tests.server.server_utils import start_server
from tests.server.test_api import metric_value

MODEL = "tiny"
FAULTS = "add:poison-add,schedule:poison-sched,postprocess:poison-post,step:poison-step:1"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start_server(tiny_model_dir("llama"), "--served-model-name", MODEL, "--max-model-len", "128",
                       "--dtype", "float32", "--fault-injection", FAULTS, log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    assert srv.stop() == 0, srv.log()


def completion(server, request_id: str | None = None, stream: bool = False, max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if request_id is not None:
        body["request_id"] = request_id
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def assert_still_serving(server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = completion(server)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 8
    deadline = time.monotonic() + 10
    while metric_value(server, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_value(server, "vllm:kv_cache_usage_perc") == 0  # the failed request's blocks were freed


@pytest.mark.parametrize("stage", ["add", "sched", "post", "step"])
def test_fault_fails_that_request_only(server, stage):
    response = completion(server, f"poison-{stage}")
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert f"poison-{stage}" in error["request_id"] and error["request_id"] in error["message"]
    assert "InjectedFault" in error["message"]
    assert error["request_id"] in server.log()  # the traceback is logged under that id
    assert_still_serving(server)


def test_a_failure_in_a_stream_carries_its_request_id(server):
    events = [json.loads(line[6:]) for line in completion(server, "poison-post-streamed", True).text.splitlines()
              if line.startswith("data: {")]
    error = events[-1]["error"]
    assert error["code"] == 500 and "poison-post-streamed" in error["request_id"]  # as a non-streamed 500's body


def test_other_clients_keep_their_streams_while_one_request_fails(server):
    """A stream running beside requests that fail while being added or post-processed completes normally."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streaming = pool.submit(completion, server, "bystander", True, 60)
        time.sleep(0.2)
        failing = [pool.submit(completion, server, f"poison-{stage}") for stage in ("add", "post", "sched")]
        assert [f.result().status_code for f in failing] == [500, 500, 500]
        lines = [line for line in streaming.result().text.splitlines() if line.startswith("data: ")]
    assert streaming.result().status_code == 200
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert_still_serving(server)


def test_model_step_failing_twice_kills_the_engine_and_exits_nonzero(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir("llama"), "--served-model-name", MODEL, "--max-model-len", "128",
                       "--dtype", "float32", "--fault-injection", "step:poison,step:engine-probe", log_dir=tmp_path)
    try:
        response = completion(srv, "poison")
        assert response.status_code == 503, response.text
        assert "retry step failed too" in response.json()["error"]["message"]
        assert srv.process.wait(30) != 0
        log = srv.log()
        assert "engine thread died" in log and "Traceback" in log
    finally:
        srv.stop()


def test_startup_failure_logs_type_and_exits_nonzero(tiny_model_dir, tmp_path):
    """A failure while loading (config.json disagreeing with the weights, found by the loader) is logged with its
    type and fix in one line (a ModelValidationError: no traceback), and the process exits 1 instead of serving
    503s forever."""
    import json
    import shutil
    import subprocess
    import sys

    from tests.server.server_utils import free_port

    model = tmp_path / "mismatched"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] *= 2
    (model / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", str(model), "--dtype", "float32",
                             "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "start-up failed: ModelValidationError: checkpoint tensor" in result.stderr
    assert "config.json does not match the weights" in result.stderr
    assert "Traceback (most recent call last)" not in result.stderr


def test_an_unexpected_startup_failure_is_logged_with_its_traceback(caplog):
    """What does not say what to fix (a bug, a fault) keeps its traceback at any phase; a settings error before
    loading and a user-facing error (ModelValidationError, ...) are one line."""
    import logging

    from pagedserve.entrypoints.openai.api_server import log_startup_failure
    from pagedserve.formats.errors import ModelValidationError

    cases = ((RuntimeError("a fault"), "loading_weights", True), (ValueError("bad value"), "loading_weights", True),
             (ValueError("bad flag"), "planning", False), (ModelValidationError("damaged"), "loading_weights", False))
    for exc, phase, traceback in cases:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="pagedserve.server"):
            try:
                raise exc
            except Exception as raised:  # noqa: BLE001 - logged with its traceback, as serve does
                log_startup_failure(raised, phase)
        error = [r for r in caplog.records if r.levelno == logging.ERROR][0]
        assert f"start-up failed: {type(exc).__name__}" in error.getMessage()
        assert (error.exc_info is not None) == traceback, (exc, phase)
