"""`pagedserve serve -tp 2` through the official openai client, and what a lost rank does to the server: the
engine is declared dead (503 to the request in flight and to new ones) and the process exits non-zero within
seconds, whether the rank dies mid-request or while the server is idle."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import psutil
import pytest

from pagedserve import LLM, SamplingParams
from tests.server.server_utils import module_server, openai_client, start_server
from tests.server.test_api import metric_value

FLAGS = ("-tp", "2", "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--omp-wait-policy", "passive")
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from module_server(tiny_model_dir("llama"), *FLAGS, tmp_path_factory=tmp_path_factory)


def worker_processes(server) -> list[psutil.Process]:
    """The server's tensor-parallel worker (spawned: its command line runs multiprocessing's spawn_main)."""
    children = psutil.Process(server.process.pid).children()
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def test_completions_equal_one_process(server, tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=512)
    expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    client = openai_client(server)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=5,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == 16 and reply.choices[0].logprobs.top_logprobs[0]
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert len(worker_processes(server)) == 1
    assert "tensor parallel: 2 ranks, collectives over shared memory" in server.log()


def completion(server, max_tokens: int) -> httpx.Response:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def wait_until_running(server) -> None:
    deadline = time.monotonic() + 30
    while metric_value(server, "vllm:num_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def tp_server(tiny_model_dir, tmp_path):
    """A two-rank server of its own (the test kills or signals it), with the model name its requests use."""
    server = start_server(tiny_model_dir("llama"), *FLAGS, log_dir=tmp_path)
    server.model = openai_client(server).models.list().data[0].id
    return server


def running(pool: concurrent.futures.ThreadPoolExecutor, server, max_tokens: int) -> concurrent.futures.Future:
    """A completion sent on `pool`, once the engine runs it."""
    in_flight = pool.submit(completion, server, max_tokens)
    wait_until_running(server)
    return in_flight


def assert_dead_and_exits_nonzero(server, killed_at: float) -> None:
    """/health turns 503 "dead" (or the port is already closed: the process is on its way out) within seconds
    of the kill, new requests get 503, and the process exits non-zero."""
    try:
        health = httpx.get(f"{server.url}/health", timeout=2)
        while health.status_code == 200 and time.monotonic() - killed_at < 10:  # the watchdog polls twice a second
            time.sleep(0.05)
            health = httpx.get(f"{server.url}/health", timeout=2)
        assert health.status_code == 503 and health.json()["phase"] == "dead"
        assert completion(server, 4).status_code == 503
    except httpx.TransportError:
        pass
    assert server.process.wait(15) != 0, server.log()
    assert time.monotonic() - killed_at < 15
    assert "rank 1" in server.log() and "exited with code -9" in server.log()


def test_a_rank_killed_mid_request_fails_it_with_503_and_the_server_exits(tiny_model_dir, tmp_path):
    server = tp_server(tiny_model_dir, tmp_path)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            in_flight = running(pool, server, 480)
            (worker,) = worker_processes(server)
            worker.kill()
            killed_at = time.monotonic()
            response = in_flight.result(30)
        assert response.status_code == 503, response.text
        assert "rank 1" in response.json()["error"]["message"]
        assert_dead_and_exits_nonzero(server, killed_at)
    finally:
        server.stop()


def test_a_rank_killed_while_idle_ends_the_server(tiny_model_dir, tmp_path):
    server = tp_server(tiny_model_dir, tmp_path)
    try:
        (worker,) = worker_processes(server)
        worker.kill()
        assert_dead_and_exits_nonzero(server, time.monotonic())
    finally:
        server.stop()


def test_a_sigterm_to_the_whole_process_group_drains_requests_and_exits_0(tiny_model_dir, tmp_path):
    """Ctrl-C, systemctl stop and `kill -- -PGID` signal every process: the ranks leave stopping to rank 0,
    which drains its requests and stops them (the ranks died at once: 503s and exit 1)."""
    import signal

    server = tp_server(tiny_model_dir, tmp_path)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            in_flight = running(pool, server, 200)
            workers = worker_processes(server)
            for process in [psutil.Process(server.process.pid), *workers]:
                process.send_signal(signal.SIGTERM)
            response = in_flight.result(60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 200
        assert server.process.wait(30) == 0, server.log()
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        server.stop()


def test_a_script_without_the_main_guard_is_told_so_and_leaves_nothing(tiny_model_dir, tmp_path):
    """Spawned ranks import the main script again: without `if __name__ == "__main__":` its LLM(...) ran in the
    rank too (a confusing WorkerLostError, and a /dev/shm file left behind each time)."""
    import glob
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text(f"from pagedserve import LLM\nLLM({tiny_model_dir('llama')!r}, tensor_parallel_size=2, "
                      "dtype='float32', max_model_len=64)\n")
    before = set(glob.glob("/dev/shm/pagedserve-tp-*"))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "if __name__ == \"__main__\":" in run.stderr, run.stderr[-2000:]
    assert set(glob.glob("/dev/shm/pagedserve-tp-*")) <= before
