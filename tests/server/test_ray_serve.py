"""`pagedserve serve --replicas 2` on a local Ray that this module starts (and stops) on 127.0.0.1: two replicas
of a tiny model behind one endpoint, driven by the official openai client.

Slow (about two minutes on 2 cores: Ray, then two engines); skipped without ray: pip install -e '.[ray]',
then python -m pytest -m slow tests/server/test_ray_serve.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.entrypoints.ray_serve.routing import rank_replicas
from tests.server.server_utils import free_port, openai_client, start_server

ray = pytest.importorskip("ray", reason="the Ray Serve tests need ray: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve", reason="the Ray Serve tests need ray[serve]: pip install -e '.[ray]'")

pytestmark = pytest.mark.slow

MODEL = "tiny"
REPLICA_HEADER = "x-pagedserve-replica"
# A request id whose model step fails, and so does the engine's retry step (its probe): that replica's engine dies.
ENGINE_KILLER = "engine-killer"
SHARED_PREFIX = ("You are the assistant of a shop that sells brown foxes and lazy dogs. Answer in one line, "
                 "politely, and never mention the capital of France or of Germany. ") * 3  # well over 256 chars


@pytest.fixture(scope="module")
def ray_address():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # Ray binds the node IP, never loopback
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def server(ray_address, tiny_model_dir, tmp_path_factory):
    server = start_server(tiny_model_dir("llama"), "--served-model-name", MODEL, "--max-model-len", "512",
                          "--dtype", "float32", "--replicas", "2", "--ray-address", ray_address,
                          "--replica-cpus", "1", "--num-threads", "1", "--omp-wait-policy", "passive",
                          "--fault-injection", f"step:{ENGINE_KILLER},step:engine-probe",
                          log_dir=tmp_path_factory.mktemp("logs"), ready_timeout=300)
    try:
        wait_for_replicas(server, 2, timeout=120)
        yield server
    finally:
        code = server.stop(timeout=60)
        try:
            assert code == 0, server.log()[-5000:]
        finally:
            serve.shutdown()


def replicas(server) -> list[dict]:
    return httpx.get(f"{server.url}/replicas", timeout=30).json()["replicas"]


def wait_for_replicas(server, count: int, timeout: float, without: str | None = None) -> list[dict]:
    """The replicas once `count` of them answer /health with 200 (and none is `without`)."""
    deadline = time.monotonic() + timeout
    while True:
        listed = replicas(server)
        healthy = [r for r in listed if r["health_status"] == 200 and r["replica"] != without]
        if len(healthy) == count:
            return healthy
        if time.monotonic() > deadline:
            raise AssertionError(f"wanted {count} healthy replicas, have {listed}")
        time.sleep(0.5)


def prefix_hits(server) -> dict[str, float]:
    """vllm:prefix_cache_hits of each replica, from the aggregated /metrics."""
    hits = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "vllm:prefix_cache_hits_total":
                hits[sample.labels["replica"]] = sample.value
    return hits


def chat(client, content: str, system: str | None = None, **kwargs):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                           temperature=0, **kwargs)
    return raw.headers[REPLICA_HEADER], raw.parse()


def test_twenty_concurrent_requests_all_succeed_on_both_replicas(server):
    client = openai_client(server)

    def one(i: int) -> str:
        if i % 4 == 3:  # streamed
            with client.completions.with_streaming_response.create(
                    model=MODEL, prompt=f"Request {i}: the quick brown fox", max_tokens=16, temperature=0,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) as raw:
                events = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: {")]
                assert events[-1]["usage"]["completion_tokens"] == 16
                return raw.headers[REPLICA_HEADER]
        if i % 2:
            raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"{i} jumps over the lazy dog",
                                                              max_tokens=16, temperature=0,
                                                              extra_body={"ignore_eos": True})
            assert raw.parse().usage.completion_tokens == 16
            return raw.headers[REPLICA_HEADER]
        replica, reply = chat(client, f"Question number {i}: what is the capital of France?")
        assert reply.choices[0].finish_reason in ("stop", "length")
        return replica

    with ThreadPoolExecutor(20) as pool:
        served_by = list(pool.map(one, range(20)))
    assert len(served_by) == 20
    assert set(served_by) == {r["replica"] for r in replicas(server)}, served_by  # 2^-19 to all land on one
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["num_ready"] == 2


def test_a_shared_prefix_stays_on_one_replica_and_hits_its_prefix_cache(server):
    client = openai_client(server)
    before = prefix_hits(server)
    served_by = [chat(client, f"Question {i}: do you sell foxes?", system=SHARED_PREFIX)[0] for i in range(5)]
    after = prefix_hits(server)
    assert len(set(served_by)) == 1, served_by
    owner = served_by[0]
    (other,) = set(after) - {owner}
    assert after[owner] > before.get(owner, 0)
    assert after[other] == before.get(other, 0)


def test_one_user_stays_on_one_replica(server):
    client = openai_client(server)
    served_by = {chat(client, f"A different question, {i}?", user="alice")[0] for i in range(4)}
    assert len(served_by) == 1


def test_per_replica_routes_and_errors_pass_through(server):
    (first, second) = (r["replica"] for r in replicas(server))
    for replica in (first, second):
        health = httpx.get(f"{server.url}/replicas/{replica}/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "ready"
        assert "vllm:num_requests_running" in httpx.get(f"{server.url}/replicas/{replica}/metrics", timeout=30).text
    assert httpx.get(f"{server.url}/replicas/nosuch/health", timeout=30).status_code == 404
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the replica's own 400


def replica_metric(server, replica: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/replicas/{replica}/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def test_a_hung_replica_does_not_hold_health_and_metrics(server):
    """The ingress asked the replicas one after another with 10 s each: one hung (here: stopped) replica made
    /health and /metrics take 10 s, past a health probe's timeout, while the other served at once."""
    import os
    import signal

    from pagedserve.entrypoints.ray_serve.ingress import HEALTH_TIMEOUT_S, METRICS_TIMEOUT_S

    pids = subprocess.run(["pgrep", "-f", "ServeReplica:pagedserve:PagedServeEngine"], capture_output=True,
                          text=True).stdout.split()
    assert len(pids) == 2, pids
    os.kill(int(pids[0]), signal.SIGSTOP)
    try:
        started = time.monotonic()
        health = httpx.get(f"{server.url}/health", timeout=30)
        took = time.monotonic() - started
        body = health.json()
        assert health.status_code == 200 and took < HEALTH_TIMEOUT_S + 3, (took, body)
        assert (body["num_replicas"], body["num_ready"]) == (2, 1), body
        assert [r["status"] for r in body["replicas"].values()].count("not answering") == 1, body
        started = time.monotonic()
        metrics = httpx.get(f"{server.url}/metrics", timeout=30)
        assert metrics.status_code == 200 and time.monotonic() - started < METRICS_TIMEOUT_S + 3
        assert "vllm:num_requests_running" in metrics.text  # the replica that answers
    finally:
        os.kill(int(pids[0]), signal.SIGCONT)
    assert httpx.get(f"{server.url}/health", timeout=30).json()["num_ready"] == 2


def test_a_client_that_leaves_mid_stream_has_its_request_aborted_on_the_replica(server):
    body = {"model": MODEL, "prompt": "A stream the client leaves", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        replica = response.headers[REPLICA_HEADER]
        aborted = replica_metric(server, replica, "vllm:request_success_total", finished_reason="abort")
        lines = response.iter_lines()
        assert [next(lines) for _ in range(3)]
    deadline = time.monotonic() + 30
    while replica_metric(server, replica, "vllm:request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "the request was not aborted on its replica"
        time.sleep(0.2)
    assert replica_metric(server, replica, "vllm:num_requests_running") == 0


@pytest.mark.parametrize("flags, refusal", [
    (["--replicas", "3"], "--replicas 3 x --replica-cpus 1 reserve 3 CPUs and this Ray cluster has 2"),
    (["--replicas", "1", "--replica-cpus", "4"], "no node of this Ray cluster has that many CPUs"),
])
def test_a_deployment_that_cannot_run_is_refused_before_deploying(server, ray_address, tiny_model_dir, flags,
                                                                  refusal):
    """Counted before deploying: Ray would wait forever for the CPUs. The application running meanwhile (the
    module's, under the same name) is left alone."""
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", tiny_model_dir("llama"), "--port",
                             str(free_port()), "--ray-address", ray_address, *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and refusal in result.stderr, result.stderr[-3000:]
    assert len(wait_for_replicas(server, 2, timeout=10)) == 2


def test_a_second_application_under_the_same_name_is_refused(server, ray_address, tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", tiny_model_dir("llama"), "--port",
                             str(free_port()), "--ray-address", ray_address, "--replicas", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "already runs on this cluster" in result.stderr, result.stderr[-3000:]
    assert len(wait_for_replicas(server, 2, timeout=10)) == 2


def stream_outcome(server, prompt: str, started: threading.Event) -> dict:
    """A long streamed completion: its replica and whether it finished or ended with an error event."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        outcome = {"replica": response.headers.get(REPLICA_HEADER), "status": response.status_code, "tokens": 0}
        if response.status_code != 200:
            outcome["error"] = json.loads(response.read())["error"]
            return outcome
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    outcome["error"] = event["error"]
                else:
                    outcome["tokens"] += 1
                    started.set()
            elif line == "data: [DONE]":
                outcome["done"] = True
    return outcome


def prompts_routed_to(replica: str, among: list[str], count: int) -> list[str]:
    """Completion prompts whose routing key (routing.py) ranks `replica` first among these replicas."""
    prompts = (f"Long answer {i} about the lazy dog" for i in range(1000))
    return [p for p in prompts if rank_replicas(f"prefix:{p}", among)[0] == replica][:count]


def long_completion(server, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def test_a_killed_replica_fails_only_its_requests_and_ray_brings_it_back(server):
    victim, survivor = replicas(server)
    to_victim = prompts_routed_to(victim["replica"], [victim["replica"], survivor["replica"]], 2)
    with ThreadPoolExecutor(10) as pool:
        whole = [pool.submit(long_completion, server, prompt) for prompt in to_victim]
        events = [threading.Event() for _ in range(8)]
        futures = [pool.submit(stream_outcome, server, f"Stream {i} about the quick brown fox", events[i])
                   for i in range(8)]
        assert all(e.wait(60) for e in events)
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        client = openai_client(server)
        during = [chat(client, f"Asked while a replica is down, {i}")[0] for i in range(6)]
        outcomes = [f.result(timeout=120) for f in futures]
        whole = [f.result(timeout=120) for f in whole]
    on_victim = [o for o in outcomes if o["replica"] == victim["replica"]]
    on_survivor = [o for o in outcomes if o["replica"] == survivor["replica"]]
    assert on_victim and on_survivor, outcomes  # 2^-7 to land on one
    assert all(o.get("done") and "error" not in o and o["tokens"] == 400 for o in on_survivor), on_survivor
    assert all(o["tokens"] == 400 or o.get("error", {}).get("code") == 503 for o in on_victim), on_victim
    assert any("error" in o and "stopped" in o["error"]["message"] for o in on_victim), on_victim
    for response in whole:  # in flight on the victim, not streamed: a 503 with an OpenAI-style body
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and "stopped" in error["message"]
    assert set(during) == {survivor["replica"]}
    back = wait_for_replicas(server, 2, timeout=120, without=victim["replica"])
    assert survivor["replica"] in {r["replica"] for r in back}
    assert chat(openai_client(server), "And after it came back?")[1].choices


def test_a_replica_whose_engine_dies_fails_its_health_check_and_is_replaced(server):
    before = {r["replica"] for r in replicas(server)}
    client = openai_client(server)
    killer = httpx.post(f"{server.url}/v1/completions", timeout=60,
                        json={"model": MODEL, "prompt": "x", "max_tokens": 4, "request_id": ENGINE_KILLER})
    assert killer.status_code == 503 and "retry step failed too" in killer.json()["error"]["message"], killer.text
    dead = killer.headers[REPLICA_HEADER]
    statuses = {r["replica"]: r["health_status"] for r in replicas(server)}
    assert statuses[dead] == 503  # the replica's own /health: the engine stopped
    answered_by = {chat(client, f"While {dead} is dying, {i}")[0] for i in range(6)}
    assert answered_by == before - {dead}  # it refuses them (engine dead): the next replica answers
    back = wait_for_replicas(server, 2, timeout=120, without=dead)  # Ray's health check replaced it
    assert len({r["replica"] for r in back} - before) == 1
