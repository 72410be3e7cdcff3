#!/usr/bin/env python
"""Soak and fault figures: a `pagedserve serve` process under steady concurrent load for a bounded time.

On 127.0.0.1 only, with a free port; the script stops the server itself (SIGTERM, which must drain and
exit 0). Client threads loop over a mix of requests:
  - ordinary chat and completion requests, streamed or not, 8-48 new tokens;
  - cancellations: a stream closed by the client after its first chunk (the server must abort it and
    free its KV blocks);
  - malformed requests: bad JSON, wrong types, values out of range, unknown model, unknown fields the
    engine cannot take (each must get a 4xx, never a 5xx);
  - queue-full bursts every --burst-every seconds: more requests at once than the queue holds
    (`--max-waiting-requests`), which must get 429 with Retry-After, not errors.
Every 10 s it samples the server's resident memory and /metrics. At the end it waits for the engine to
drain and reads the KV-cache usage (blocks still referenced = leaked). Report: benchmarks/RELIABILITY.md
(--report) with requests served, 5xx count, 429s (with/without Retry-After), leaked KV blocks, RSS drift
from minute 5 to the end, and p50/p99 latency of ordinary requests per 5-minute window.

    python benchmarks/soak.py [--model smollm2-135m-instruct] [--minutes 30] [--clients 6] [--report]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from comparison.children import stop, stop_on_sigterm  # noqa: E402
MALFORMED = [  # (body bytes or JSON object, path): each must be refused with a 4xx
    (b"{not json", "/v1/chat/completions"),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions"),
    ({"messages": "not a list"}, "/v1/chat/completions"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "/v1/chat/completions"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "/v1/chat/completions"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 10 ** 6}, "/v1/chat/completions"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 5}}, "/v1/chat/completions"),
    ({"prompt": [10 ** 9], "max_tokens": 4}, "/v1/completions"),
    ({"prompt": "x", "max_tokens": 10 ** 9}, "/v1/completions"),
    ({"prompt": "x", "logprobs": 10 ** 4}, "/v1/completions"),
    ({"prompt": "x", "stop": ["a"] * 100}, "/v1/completions"),
    ({"prompt": "x", "top_p": -1}, "/v1/completions"),
]
WORDS = "the a server memory model token cache block stream request answer question paris river code".split()


@dataclass
class Record:
    t: float  # seconds since the load started
    kind: str  # ordinary, cancel, malformed, burst
    status: int  # HTTP status, or 0 for a transport error
    latency: float
    retry_after: bool = False


@dataclass
class Soak:
    url: str
    model: str
    started: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: Record) -> None:
        with self.lock:
            self.records.append(record)

    def now(self) -> float:
        return time.monotonic() - self.started

    def ordinary(self, client: httpx.Client, rng: random.Random, cancel: bool = False, kind: str = "ordinary") -> None:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
        tokens = rng.randint(8, 48)
        if rng.random() < 0.5:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
        else:
            path, body = "/v1/completions", {"prompt": text}
        body.update(model=self.model, max_tokens=tokens, temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 99))
        stream = cancel or rng.random() < 0.5
        start = time.monotonic()
        try:
            if stream:
                with client.stream("POST", self.url + path, json={**body, "stream": True}) as response:
                    status = response.status_code
                    for _ in response.iter_lines():
                        if cancel:
                            break  # closing the connection mid-stream: the server must abort the request
            else:
                response = client.post(self.url + path, json=body)
                status = response.status_code
            retry = "retry-after" in response.headers
        except httpx.HTTPError:
            status, retry = 0, False
        self.add(Record(self.now(), kind, status, time.monotonic() - start, retry))

    def malformed(self, client: httpx.Client, rng: random.Random) -> None:
        body, path = rng.choice(MALFORMED)
        start = time.monotonic()
        try:
            if isinstance(body, bytes):
                response = client.post(self.url + path, content=body, headers={"content-type": "application/json"})
            else:
                response = client.post(self.url + path, json={"model": self.model, **body} if "model" not in body
                                       else body)
            status = response.status_code
        except httpx.HTTPError:
            status = 0
        self.add(Record(self.now(), "malformed", status, time.monotonic() - start))


def client_loop(soak: Soak, seed: int, deadline: float) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=120.0) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.1:
                soak.malformed(client, rng)
            elif roll < 0.2:
                soak.ordinary(client, rng, cancel=True, kind="cancel")
            else:
                soak.ordinary(client, rng)


def burst_loop(soak: Soak, every: float, size: int, deadline: float) -> None:
    rng = random.Random(12345)
    while time.monotonic() + every < deadline:
        time.sleep(every)
        threads = [threading.Thread(target=lambda s=i: _one_burst(soak, rng.randint(0, 10 ** 6) + s)) for i in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _one_burst(soak: Soak, seed: int) -> None:
    with httpx.Client(timeout=120.0) as client:
        soak.ordinary(client, random.Random(seed), kind="burst")


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


def sample_loop(url: str, pid: int, soak: Soak, samples: list[dict], deadline: float) -> None:
    process = psutil.Process(pid)
    while time.monotonic() < deadline:
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
            samples.append({"t": soak.now(), "rss": process.memory_info().rss,
                            "kv": metric(text, "vllm:kv_cache_usage_perc"),
                            "running": metric(text, "vllm:num_requests_running")})
        except (httpx.HTTPError, psutil.Error):
            samples.append({"t": soak.now(), "rss": None, "kv": None, "running": None})
        time.sleep(10)


def start_server(model: str, flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "pagedserve", "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"server exited with {server.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(server, grace=5)
    raise SystemExit(f"server not ready after 300 s; see {log}")


def drain(url: str, timeout: float = 120.0) -> float | None:
    """KV-cache usage once nothing is running or waiting (None if it never drained)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        if metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0:
            return metric(text, "vllm:kv_cache_usage_perc")
        time.sleep(0.5)
    return None


def windows(records: list[Record], minutes: float, width_min: float = 5.0) -> list[tuple[str, int, float, float]]:
    rows = []
    start = 0.0
    while start < minutes * 60:
        end = start + width_min * 60
        lat = sorted(r.latency for r in records if r.kind == "ordinary" and r.status == 200 and start <= r.t < end)
        if lat:
            p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
            rows.append((f"{start / 60:.0f}-{end / 60:.0f} min", len(lat), statistics.median(lat), p99))
        start = end
    return rows


def render(args: argparse.Namespace, soak: Soak, samples: list[dict], leaked: float | None, num_blocks: int | None,
           exit_code: int, wall: float) -> str:
    recs = soak.records
    by_kind = {kind: [r for r in recs if r.kind == kind] for kind in ("ordinary", "cancel", "malformed", "burst")}
    server_errors = [r for r in recs if r.status >= 500]
    transport = [r for r in recs if r.status == 0 and r.kind != "cancel"]
    refused = [r for r in recs if r.status == 429]
    malformed_ok = sum(1 for r in by_kind["malformed"] if 400 <= r.status < 500)
    rss = [(s["t"], s["rss"]) for s in samples if s["rss"]]
    after5 = [v for t, v in rss if t >= 300] or [v for _, v in rss]
    drift = (after5[-1] - after5[0]) / after5[0] * 100 if len(after5) > 1 else float("nan")
    leaked_blocks = "unknown (did not drain)" if leaked is None else (
        f"{round(leaked * num_blocks)} of {num_blocks}" if num_blocks else f"usage {leaked:.4f}")
    from pagedserve.memory.probe import cpu_class, cpu_flags

    load = os.getloadavg()
    lines = ["# Reliability: soak and fault figures", "",
             f"Measured {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')} by "
             f"`python benchmarks/soak.py {' '.join(sys.argv[1:])}` on a {os.cpu_count()}-CPU machine "
             f"(CPU class `{cpu_class(cpu_flags())}`): `pagedserve serve {args.model} {' '.join(args.server_flags)}`, "
             f"{args.clients} client threads for {args.minutes:g} min ({wall / 60:.1f} min with drain and stop), "
             f"a burst of {args.burst_size} requests every {args.burst_every:g} s. 127.0.0.1 only; the script "
             f"starts and stops the server itself. Load average at the end {load[0]:.2f} / {load[1]:.2f} / "
             f"{load[2]:.2f} (1 / 5 / 15 min; the server and this script's clients included).", "",
             "| Figure | Value | Goal |", "|---|---|---|",
             f"| requests sent | {len(recs)} (ordinary {len(by_kind['ordinary'])}, cancelled streams "
             f"{len(by_kind['cancel'])}, malformed {len(by_kind['malformed'])}, burst {len(by_kind['burst'])}) | |",
             f"| ordinary requests served (200) | {sum(1 for r in by_kind['ordinary'] if r.status == 200)} | all |",
             f"| 5xx answers | {len(server_errors)} | 0 |",
             f"| transport errors (not counting the client's own cancellations) | {len(transport)} | 0 |",
             f"| malformed requests refused with a 4xx | {malformed_ok} of {len(by_kind['malformed'])} | all |",
             f"| 429 (queue full) | {len(refused)}, {sum(r.retry_after for r in refused)} with Retry-After | "
             "all with Retry-After |",
             f"| KV blocks still referenced after drain (leaked) | {leaked_blocks} | 0 |",
             f"| RSS from minute 5 to the end | {after5[0] / 2**20:.0f} -> {after5[-1] / 2**20:.0f} MiB "
             f"({drift:+.1f} %) | < 5 % |" if after5 else "| RSS | not sampled | |",
             f"| server exit code after SIGTERM | {exit_code} | 0 |", "",
             "Latency of ordinary requests answered 200 (stream or not, 8-48 tokens), per window:", "",
             "| Window | requests | p50 s | p99 s |", "|---|---|---|---|"]
    lines += [f"| {w} | {n} | {p50:.2f} | {p99:.2f} |" for w, n, p50, p99 in windows(recs, args.minutes)]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--burst-every", type=float, default=120.0)
    parser.add_argument("--burst-size", type=int, default=24)
    parser.add_argument("--report", action="store_true", help="write benchmarks/RELIABILITY.md")
    parser.add_argument("--server-flags", nargs="*", default=["--max-num-seqs", "8", "--max-waiting-requests", "8",
                                                             "--max-model-len", "1024", "--omp-wait-policy", "passive"])
    args = parser.parse_args()
    stop_on_sigterm()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-server-{os.getpid()}.log"
    server, url = start_server(args.model, args.server_flags, log)
    started = time.monotonic()
    soak = Soak(url, httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])
    deadline = soak.started + args.minutes * 60
    samples: list[dict] = []
    threads = [threading.Thread(target=client_loop, args=(soak, i, deadline)) for i in range(args.clients)]
    threads += [threading.Thread(target=burst_loop, args=(soak, args.burst_every, args.burst_size, deadline)),
                threading.Thread(target=sample_loop, args=(url, server.pid, soak, samples, deadline), daemon=True)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads[:-1]:
            thread.join()
        leaked = drain(url)
    finally:
        exit_code = stop(server, grace=60)
    blocks = _num_blocks(log)
    report = render(args, soak, samples, leaked, blocks, exit_code, time.monotonic() - started)
    print(report)
    (HERE / "out").mkdir(exist_ok=True)
    (HERE / "out" / "soak.json").write_text(json.dumps({"records": [r.__dict__ for r in soak.records],
                                                         "samples": samples}))
    if args.report:
        (HERE / "RELIABILITY.md").write_text(report)
    return 0


def _num_blocks(log: Path) -> int | None:
    """The KV pool's block count, from the server's start-up log."""
    match = re.search(r"KV cache\s+[0-9.]+ GiB\s+([0-9,]+) blocks", log.read_text(errors="replace"))
    return int(match.group(1).replace(",", "")) if match else None


if __name__ == "__main__":
    sys.exit(main())
