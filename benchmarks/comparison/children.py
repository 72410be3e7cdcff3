"""Fresh processes a benchmark measures, which it must not leave behind when it stops early.

Each child runs in a process group of its own (with whatever it starts: a server, a worker), killed when the call
returns, normally or not: an exception, Ctrl-C, or, after `stop_on_sigterm`, the SIGTERM `timeout` sends. Before,
a benchmark killed by `timeout` left its running child measuring beside the next run. A child that outlives one call
(a server the benchmark talks to) is started with `start_new_session=True` and ended by `stop`, in a `finally`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence


def stop_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in the main thread, so the `finally` of `run` kills the child's group."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def run(command: Sequence[str], *, check: bool = False, timeout: float | None = None, stderr=subprocess.PIPE,
        **kwargs) -> subprocess.CompletedProcess[str]:
    """subprocess.run(command, capture_output=True, text=True, check=check, timeout=timeout, **kwargs), the child's
    process group killed on the way out (anything it left running included); `stderr`: where its stderr goes
    instead of the result (a log file)."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
                             **kwargs)
    try:
        out, err = child.communicate(timeout=timeout)
    finally:
        _kill_group(child)
    done = subprocess.CompletedProcess(list(command), child.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def stop(process: subprocess.Popen, grace: float = 30.0) -> int:
    """End `process` (started with start_new_session=True) and what it started: SIGTERM, up to `grace` seconds to
    exit (a server drains and says how it went), then SIGKILL to its whole process group. Its exit status."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    return _kill_group(process)


def _kill_group(process: subprocess.Popen) -> int:
    """SIGKILL to `process`'s group (its own session: what it started included), once it may still run; its status."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return process.wait()
