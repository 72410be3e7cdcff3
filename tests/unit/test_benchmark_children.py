"""benchmarks/comparison/children.py: a benchmark's child, and whatever it started, never outlive the call, even when
the benchmark itself is stopped by `timeout`'s SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from comparison import children  # noqa: E402

# A child that starts a grandchild (as interleaved.py's ready child starts a server), writes its pid, then waits.
PARENT = """
import subprocess, sys, time
sleeper = subprocess.Popen(["sleep", "120"])
open(sys.argv[1], "w").write(str(sleeper.pid))
time.sleep(120)
"""


def _gone(pid: int, within: float = 10.0) -> bool:
    """True once `pid` no longer runs (gone, or a zombie waiting for its reaper)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def _pid_from(path: Path, within: float = 20.0) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError("the child never wrote its grandchild's pid")


def test_a_finished_child_gives_its_output_and_status(tmp_path: Path) -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    done = children.run([sys.executable, "-c", code])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    with open(tmp_path / "log", "w") as log:  # stderr to a log file (compare's W3 children)
        done = children.run([sys.executable, "-c", code], stderr=log)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", None)
    assert (tmp_path / "log").read_text() == "err\n"
    with pytest.raises(subprocess.CalledProcessError):
        children.run([sys.executable, "-c", "import sys; sys.exit(1)"], check=True)


def test_a_timed_out_child_takes_what_it_started_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        children.run([sys.executable, "-c", PARENT, str(pid_file)], timeout=3)
    assert _gone(_pid_from(pid_file))


def test_sigterm_to_the_benchmark_kills_its_running_child_and_grandchild(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    benchmark = subprocess.Popen([sys.executable, "-c", (
        f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "from comparison import children\n"
        "children.stop_on_sigterm()\n"
        f"children.run([sys.executable, '-c', {PARENT!r}, {str(pid_file)!r}])\n")])
    try:
        grandchild = _pid_from(pid_file)
        benchmark.send_signal(signal.SIGTERM)
        assert benchmark.wait(20) == 128 + signal.SIGTERM
        assert _gone(grandchild)
    finally:
        benchmark.kill()
        benchmark.wait()


# A server-like child: exits with 7 on SIGTERM, after starting a grandchild that ignores SIGTERM.
SERVER = """
import signal, subprocess, sys, time
sleeper = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                            "time.sleep(120)"])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
open(sys.argv[1], "w").write(str(sleeper.pid))
time.sleep(120)
"""


def test_stop_ends_a_long_lived_child_gracefully_and_then_its_whole_group(tmp_path: Path) -> None:
    """`stop` (soak's server, compare's workers): the child's own exit status after SIGTERM, and whatever it left
    running, even a process that ignores SIGTERM, killed with the group."""
    pid_file = tmp_path / "pid"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(pid_file)], start_new_session=True)
    try:
        grandchild = _pid_from(pid_file)
        assert children.stop(server, grace=20) == 7
        assert _gone(grandchild)
    finally:
        server.kill()
        server.wait()
