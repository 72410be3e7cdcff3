"""`pagedserve watch` on fake /proc trees and recorded samples: busy is not stuck; rising D is."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import httpx
import pytest

from pagedserve.cli import watch
from pagedserve.cli.watch import Sample, ThreadCounts, classify


def make_proc(root: Path, load1: float, processes: dict[int, tuple[int, str, str, int]]) -> Path:
    """A fake /proc: processes maps pid -> (ppid, comm, thread states e.g. "RRS", VmRSS in KiB)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "loadavg").write_text(f"{load1:.2f} 1.00 0.50 3/400 12345\n")
    (root / "self").mkdir(exist_ok=True)  # non-numeric entries are not processes
    tid = 100000
    for pid, (ppid, comm, states, rss_kib) in processes.items():
        proc = root / str(pid)
        (proc / "task").mkdir(parents=True, exist_ok=True)
        (proc / "stat").write_text(f"{pid} ({comm}) {states[0]} {ppid} 1 1 0 -1 4194560 0 0\n")
        (proc / "status").write_text(f"Name:\t{comm}\nVmRSS:\t{rss_kib} kB\nThreads:\t{len(states)}\n")
        for i, state in enumerate(states):
            task = proc / "task" / str(pid if i == 0 else tid)
            task.mkdir(exist_ok=True)
            (task / "stat").write_text(f"{task.name} ({comm}) {state} {ppid} 1 1 0\n")
            tid += 1
    return root


def sample_from(root: Path, pid: int | None, t: float) -> Sample:
    return watch.take_sample(root, pid, health="-", now=t)


def test_parse_stat_with_spaces_and_parens_in_comm() -> None:
    stat = watch.parse_stat("4242 (python (worker) 1) D 4200 4242 4242 0 -1 4194560\n")
    assert (stat.pid, stat.comm, stat.state, stat.ppid) == (4242, "python (worker) 1", "D", 4200)


def test_tree_counts_and_rss(tmp_path: Path) -> None:
    root = make_proc(tmp_path / "proc", 3.0, {
        1: (0, "init", "S", 1000),
        500: (1, "pagedserve", "RRSD", 200_000),  # the server: 4 threads
        501: (500, "tokenizer worker", "RS", 50_000),
        502: (501, "grandchild", "D", 10_000),
        900: (1, "other", "RRD", 5_000),
    })
    assert watch.process_tree(root, 500) == [500, 501, 502]
    sample = sample_from(root, 500, 0.0)
    assert sample.load1 == 3.0
    assert sample.system == ThreadCounts(running=2 + 1 + 2, blocked=1 + 1 + 1)
    assert sample.tree == ThreadCounts(running=3, blocked=2)
    assert sample.tree_rss_bytes == (200_000 + 50_000 + 10_000) * 1024
    gone = sample_from(root, 4242, 0.0)
    assert gone.tree is None and gone.tree_rss_bytes is None
    assert "gone" in watch.format_sample(gone, watch.Verdict("OK", ""))


def test_high_load_with_few_d_is_busy_not_stuck(tmp_path: Path) -> None:
    # The field report's numbers: load 15 -> 27 on 8 cores while D stays at 0..2. It was warming up.
    samples = []
    for t, (load1, d) in enumerate([(15.83, 1), (16.17, 2), (26.77, 1), (20.13, 1), (24.69, 2), (27.19, 1)]):
        root = make_proc(tmp_path / f"proc{t}", load1, {
            1: (0, "init", "S", 1000),
            500: (1, "vllm", "R" * 15 + "D" * d + "S" * 4, 7_000_000),
        })
        samples.append(sample_from(root, 500, float(t)))
        verdict = classify(samples, num_cpus=8)
        assert verdict.state == "BUSY", verdict
    assert "not stuck" in verdict.reason


def test_rising_d_is_stuck(tmp_path: Path) -> None:
    samples = []
    states = []
    for t, d in enumerate([1, 3, 5, 6, 8]):
        root = make_proc(tmp_path / f"proc{t}", 2.0 + d, {
            1: (0, "init", "S", 1000),
            500: (1, "pagedserve", "R" + "D" * d + "S" * 3, 9_000_000),
        })
        samples.append(sample_from(root, 500, float(t)))
        states.append(classify(samples, num_cpus=8).state)
    # 1 -> 3 -> 5 reaches 5 while rising: stuck from the third sample on.
    assert states == ["OK", "OK", "STUCK", "STUCK", "STUCK"]
    verdict = classify(samples, num_cpus=8)
    assert "server D-state threads 5 -> 6 -> 8" in verdict.reason


def test_high_but_falling_d_is_not_stuck(tmp_path: Path) -> None:
    samples = []
    for t, d in enumerate([9, 8, 8, 7, 6]):
        root = make_proc(tmp_path / f"proc{t}", 1.5, {500: (1, "pagedserve", "S" + "D" * d, 1000)})
        samples.append(sample_from(root, 500, float(t)))
        assert classify(samples, num_cpus=4).state != "STUCK"
    assert "not rising" in classify(samples, num_cpus=4).reason


def recorded(blocked: list[int], load1: float = 1.0, tree: bool = False) -> list[Sample]:
    return [
        Sample(time=float(i), load1=load1, system=ThreadCounts(running=2, blocked=d),
               pid=500 if tree else None, tree=ThreadCounts(1, d) if tree else None)
        for i, d in enumerate(blocked)
    ]


@pytest.mark.parametrize("blocked, state", [
    ([5, 5, 5], "OK"),  # flat: no net rise
    ([4, 4, 5], "STUCK"),  # non-decreasing, net rise, reaches 5
    ([2, 3, 4], "OK"),  # rising but below 5
    ([9, 6, 7], "OK"),  # fell within the window
    ([0, 9], "OK"),  # fewer samples than the window: not yet
    ([], "OK"),
])
def test_classify_recorded_system_samples(blocked: list[int], state: str) -> None:
    assert classify(recorded(blocked), num_cpus=2).state == state


def test_a_server_gone_or_not_answering_is_down() -> None:
    def health(texts: list[str], tree: bool = True) -> list[Sample]:
        return [Sample(time=float(i), load1=0.1, system=ThreadCounts(1, 0), pid=500,
                       tree=ThreadCounts(1, 0) if tree else None, health=text) for i, text in enumerate(texts)]

    assert classify(health(["ready", "unreachable", "unreachable"]), num_cpus=2).state == "OK"  # not yet
    assert classify(health(["unreachable"] * 3), num_cpus=2).state == "DOWN"
    assert "/health unreachable" in classify(health(["unreachable"] * 3), num_cpus=2).reason
    assert classify(health(["unreachable", "unreachable", "ready"]), num_cpus=2).state == "OK"
    assert classify(health(["ready", "-"]), num_cpus=2).state == "OK"
    gone = classify(health(["ready"], tree=False), num_cpus=2)
    assert (gone.state, gone.reason) == ("DOWN", "the server (pid 500) is gone")


def test_a_young_server_that_has_not_opened_its_port_is_starting() -> None:
    """`watch --pid` right after `serve` said DOWN while the process was importing (QA-P): a --pid process younger
    than STARTING_GRACE_S is starting; an older one, or one without --pid, is down."""
    def unreachable(age_s: float | None, pid: int | None = 500) -> list[Sample]:
        return [Sample(time=float(i), load1=0.1, system=ThreadCounts(1, 0), pid=pid,
                       tree=ThreadCounts(1, 0) if pid else None, health="unreachable", age_s=age_s)
                for i in range(3)]

    young = classify(unreachable(4.0), num_cpus=2)
    assert young.state == "OK" and "started 4 s ago" in young.reason
    assert classify(unreachable(watch.STARTING_GRACE_S + 1), num_cpus=2).state == "DOWN"
    assert classify(unreachable(None, pid=None), num_cpus=2).state == "DOWN"


def test_take_sample_reads_the_pid_s_age() -> None:
    sample = watch.take_sample("/proc", os.getpid(), "unreachable")
    assert sample.age_s is not None and 0 <= sample.age_s < 3600


def test_load_alone_never_makes_stuck() -> None:
    assert classify(recorded([0, 0, 0], load1=300.0), num_cpus=2).state == "BUSY"
    assert classify(recorded([0, 0, 0], load1=0.5), num_cpus=2).state == "OK"


def test_a_past_minute_of_load_with_nothing_running_now_is_not_busy() -> None:
    """QA-AG: a minute after a load ended, the 1-minute average still said BUSY with only watch itself running."""
    idle = [Sample(time=float(i), load1=2.19, system=ThreadCounts(running=1, blocked=0)) for i in range(3)]
    verdict = classify(idle, num_cpus=2)
    assert verdict.state == "OK" and "the load has passed" in verdict.reason


def test_health_descriptions() -> None:
    assert watch.describe_health(200, {"status": "ok"}) == "ready"
    assert watch.describe_health(503, {"status": "starting", "phase": "loading_weights", "progress": 0.43}) == (
        "503 loading_weights 43%"
    )
    assert watch.describe_health(503, {"phase": "warming_up"}) == "503 warming_up"
    assert watch.describe_health(500, None) == "500"
    assert watch.describe_health(200, {"status": "ready", "memory_pressure": {"active": True}}) == (
        "ready memory_pressure")


def test_fetch_health_over_http_and_unreachable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health"
        return httpx.Response(503, json={"phase": "loading_weights", "progress": 0.5})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        assert watch.fetch_health(client, "http://server:8000/") == watch.Health("503 loading_weights 50%")

    def serving(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ready", "memory": {"rss_bytes": 3 << 29, "expected_bytes": 1 << 30}})

    with httpx.Client(transport=httpx.MockTransport(serving)) as client:
        assert watch.fetch_health(client, "http://server:8000") == watch.Health("ready", 1 << 30, 3 << 29)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with httpx.Client(transport=httpx.MockTransport(refuse)) as client:
        assert watch.fetch_health(client, "http://server:8000") == watch.Health("unreachable")


def test_rss_is_shown_against_the_plan(tmp_path: Path) -> None:
    root = make_proc(tmp_path / "proc", 0.5, {1: (0, "init", "S", 1000), 500: (1, "pagedserve", "S", 1 << 20)})
    sample = watch.take_sample(root, 500, "ready", now=0.0, planned_rss=(1 << 30) + (1 << 28))
    assert "rss=1.00GiB/plan 1.25GiB (-20%)" in watch.format_sample(sample, watch.Verdict("OK", ""))
    assert "rss=1.00GiB  " in watch.format_sample(sample_from(root, 500, 0.0), watch.Verdict("OK", ""))
    assert watch.health_memory_bytes({"memory": {"expected_bytes": True}}, "expected_bytes") is None
    # Without --pid: the server's own reading from /health (the column was silently missing, QA-O).
    unwatched = watch.take_sample(root, None, "ready", now=0.0, planned_rss=1 << 30, reported_rss=3 << 28)
    line = watch.format_sample(unwatched, watch.Verdict("OK", ""))
    assert "server rss=0.75GiB/plan 1.00GiB (-25%) (its /health; --pid: live)" in line, line
    assert "rss" not in watch.format_sample(watch.take_sample(root, None, "-", now=0.0), watch.Verdict("OK", ""))


def test_watch_command_json_lines_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_proc(tmp_path / "proc", 0.2, {1: (0, "init", "S", 1000), 500: (1, "pagedserve", "RS", 2048)})
    args = argparse.Namespace(pid=500, url="", interval=0.0, count=2, json=True)
    assert watch.watch(args, proc_root=root) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2
    assert lines[0]["tree"] == {"running": 1, "blocked": 0} and lines[0]["tree_rss_bytes"] == 2048 * 1024
    assert lines[0]["health"] == "-" and lines[0]["verdict"] == "OK"
    args = argparse.Namespace(pid=None, url="http://127.0.0.1:9", interval=0.0, count=3, json=False)
    assert watch.watch(args, proc_root=root) == 1  # nothing listens on port 9 (discard): DOWN
    assert "DOWN: /health unreachable over the last 3 samples" in capsys.readouterr().out


def test_register_parses_the_flags() -> None:
    parser = argparse.ArgumentParser()
    watch.register(parser.add_subparsers())
    args = parser.parse_args(["watch", "--pid", "12", "--interval", "15", "--count", "3", "--json"])
    assert (args.pid, args.interval, args.count, args.json, args.func) == (12, 15.0, 3, True, watch.run)
    assert args.url == "http://127.0.0.1:8000"


@pytest.mark.parametrize("interval,count,word", [(-1.0, 2, "--interval must be"), (1.0, 0, "--count must be")])
def test_bad_interval_or_count_is_a_message_not_a_traceback(tmp_path: Path, capsys, interval, count, word) -> None:
    root = make_proc(tmp_path / "proc", 0.2, {1: (0, "init", "S", 1000)})
    args = argparse.Namespace(pid=1, url="", interval=interval, count=count, json=True)
    assert watch.watch(args, proc_root=root) == 2
    assert word in capsys.readouterr().err


def test_count_stops_after_n_samples_whatever_n(capsys) -> None:
    """--count 14 and more never stopped: the loop counted the samples it keeps (a window of 13)."""
    import argparse

    from pagedserve.cli import watch

    parser = argparse.ArgumentParser()
    watch.register(parser.add_subparsers())
    args = parser.parse_args(["watch", "--url", "", "--interval", "0", "--count", "20"])
    assert args.func(args) in (0, 1)
    assert len([line for line in capsys.readouterr().out.splitlines() if not line.startswith("  ")]) == 20


def test_a_unix_socket_url_uses_a_socket_transport() -> None:
    from pagedserve.cli.watch import unix_socket_url

    assert unix_socket_url("http://127.0.0.1:8000") == ("http://127.0.0.1:8000", None)
    for url in ("unix:/tmp/s.sock", "unix:///tmp/s.sock", "unix:rel.sock"):
        base, transport = unix_socket_url(url)
        assert base == "http://localhost" and transport is not None
    from pagedserve.benchmarks.client import unix_socket_path

    assert unix_socket_path("unix:rel.sock") == "rel.sock"  # relative, as serve --uds rel.sock made it (was /rel.sock)
    assert unix_socket_path("unix:/tmp/s.sock") == unix_socket_path("unix:///tmp/s.sock") == "/tmp/s.sock"


def test_server_urls_as_users_give_them() -> None:
    """`127.0.0.1:8000` (no scheme) read as unreachable; `.../v1` asked /v1/v1/models (bench serve)."""
    from pagedserve.benchmarks.client import server_url

    assert server_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert server_url("http://h:1/v1/") == server_url("http://h:1") == "http://h:1"
    assert server_url("https://h/api") == "https://h/api" and server_url("unix:/s.sock") == "unix:/s.sock"


@pytest.mark.parametrize("url, says", [("http://127.0.0.1:abc", "Invalid port"), ("ftp://x", "not an http(s) URL"),
                                       ("notaurl", "not an http(s) URL"), ("http://127.0.0.1:99999", "port 99999")])
def test_a_bad_url_is_refused_before_sampling(url, says, capsys):
    """It was an httpx traceback, or sampled as 'unreachable' and judged OK."""
    from pagedserve.cli.main import main

    assert main(["watch", "--url", url, "--count", "1"]) == 2
    assert says in capsys.readouterr().err


def test_a_reader_that_leaves_ends_the_watch_quietly():
    """`pagedserve watch | head -1`: a BrokenPipeError traceback before."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "pagedserve", "watch", "--url", "", "--interval", "0.01",
                                "--count", "500"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.readline()
    process.stdout.close()
    assert process.wait(timeout=60) == 1 and b"Traceback" not in process.stderr.read()
