"""`pagedserve watch`: one line per sample — load, R and D threads, RSS (against the server's memory plan), the
server's /health phase — and a verdict.

High load is not a fault; stuck I/O is. Load average counts runnable (R) and uninterruptible (D) threads
together, so a server busy computing on 16 threads shows load 16+ while being perfectly healthy. Only
D-state threads piling up (>= 5 and rising over several samples) mean that the machine waits on I/O that
does not complete (page-cache thrashing, a dead disk or network mount): that is STUCK. Everything is read
from a proc root path, so tests feed fake /proc trees; classify() is pure so tests feed recorded samples.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.engine.arg_utils import DefaultsHelpFormatter
from pagedserve.memory.sizes import GIB

if TYPE_CHECKING:  # httpx is imported when the command runs: `pagedserve serve` imports every sub-command
    import httpx

STUCK_MIN_BLOCKED = 5  # D-state threads at or above this, and rising, mean stuck
STUCK_WINDOW = 3  # samples over which D must be non-decreasing with a net rise
HEALTH_TIMEOUT_S = 2.0
# A --pid process this young whose /health does not answer is still starting (its port opens after the imports:
# seconds, longer on a loaded box), not down.
STARTING_GRACE_S = 60.0
FAULTS = ("STUCK", "DOWN")  # verdicts that make the exit code 1


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    state: str  # R running, S sleeping, D uninterruptible (I/O), Z zombie, ...
    ppid: int


@dataclass(frozen=True)
class ThreadCounts:
    running: int  # R
    blocked: int  # D


@dataclass(frozen=True)
class Sample:
    time: float  # seconds since the epoch
    load1: float
    system: ThreadCounts
    pid: int | None = None  # the server's main process (--pid)
    tree: ThreadCounts | None = None  # its process tree; None without --pid or once it is gone
    tree_rss_bytes: int | None = None
    health: str = "-"  # "ready", "503 loading_weights 43%", "unreachable", "-" (not asked)
    planned_rss_bytes: int | None = None  # what the server's plan expects resident now (/health "memory")
    reported_rss_bytes: int | None = None  # the server's own last RSS reading (/health), shown without --pid
    age_s: float | None = None  # how long ago the --pid process started


@dataclass(frozen=True)
class Health:
    """What /health said: its phase in words, and once it is serving the resident memory its plan expects and
    the server's own last reading of it."""

    text: str
    planned_rss_bytes: int | None = None
    reported_rss_bytes: int | None = None


@dataclass(frozen=True)
class Verdict:
    state: str  # "OK", "BUSY", "STUCK" or "DOWN"
    reason: str


# ----------------------------------------------------------------------------------------------- /proc


def parse_stat(text: str) -> ProcStat:
    """Parse /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat: "pid (comm) state ppid ...".

    comm may hold spaces and parentheses, so split at the last ')'.
    """
    head, _, rest = text.rpartition(")")
    pid_text, _, comm = head.partition(" (")
    fields = rest.split()
    return ProcStat(pid=int(pid_text), comm=comm, state=fields[0], ppid=int(fields[1]))


def _read_stat(path: Path) -> ProcStat | None:
    try:
        return parse_stat(path.read_text())
    except (OSError, ValueError, IndexError):  # the task exited between listing and reading
        return None


def list_pids(proc_root: str | Path = "/proc") -> list[int]:
    try:
        return sorted(int(entry.name) for entry in Path(proc_root).iterdir() if entry.name.isdigit())
    except OSError:
        return []


def thread_states(proc_root: str | Path, pid: int) -> list[str]:
    """State letter of every thread of a process (from task/<tid>/stat)."""
    task_dir = Path(proc_root) / str(pid) / "task"
    try:
        tids = [entry.name for entry in task_dir.iterdir() if entry.name.isdigit()]
    except OSError:
        return []
    stats = (_read_stat(task_dir / tid / "stat") for tid in tids)
    return [stat.state for stat in stats if stat is not None]


def count_states(states: list[str]) -> ThreadCounts:
    return ThreadCounts(running=sum(s == "R" for s in states), blocked=sum(s == "D" for s in states))


def thread_counts(proc_root: str | Path, pids: list[int]) -> ThreadCounts:
    return count_states([state for pid in pids for state in thread_states(proc_root, pid)])


def process_tree(proc_root: str | Path, root_pid: int) -> list[int]:
    """root_pid and all its descendants that are alive (from the ppid field of every process's stat)."""
    children: dict[int, list[int]] = {}
    alive = set()
    for pid in list_pids(proc_root):
        stat = _read_stat(Path(proc_root) / str(pid) / "stat")
        if stat is not None:
            alive.add(pid)
            children.setdefault(stat.ppid, []).append(pid)
    if root_pid not in alive:
        return []
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(tree)


def rss_bytes(proc_root: str | Path, pid: int) -> int:
    """VmRSS of a process (0 for kernel threads and exited processes)."""
    try:
        for line in (Path(proc_root) / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def read_load1(proc_root: str | Path = "/proc") -> float:
    return float((Path(proc_root) / "loadavg").read_text().split()[0])


# ----------------------------------------------------------------------------------------------- health


def describe_health(status_code: int, body: object) -> str:
    """"ready" for 200, else the code and the phase of a body such as {"phase": "loading_weights", "progress": 0.43}."""
    if not isinstance(body, dict):
        return "ready" if status_code == 200 else str(status_code)
    phase = body.get("phase") or body.get("status") or ""
    progress = body.get("progress")
    if isinstance(progress, (int, float)) and not isinstance(progress, bool):
        percent = progress * 100 if progress <= 1 else progress
        phase = f"{phase} {percent:.0f}%"
    if status_code == 200:
        pressure = body.get("memory_pressure")
        return "ready memory_pressure" if isinstance(pressure, dict) and pressure.get("active") else "ready"
    return f"{status_code} {phase}".strip()


def health_memory_bytes(body: object, key: str) -> int | None:
    """A byte count of a /health body's "memory": "expected_bytes", what the plan expects resident now, or
    "rss_bytes", the server's own last reading."""
    memory = body.get("memory") if isinstance(body, dict) else None
    value = memory.get(key) if isinstance(memory, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def fetch_health(client: httpx.Client, url: str) -> Health:
    import httpx

    try:
        response = client.get(url.rstrip("/") + "/health", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError:
        return Health("unreachable")  # port not open yet, or the server is gone: the samples above tell which
    try:
        body = response.json()
    except ValueError:
        body = None
    return Health(describe_health(response.status_code, body), health_memory_bytes(body, "expected_bytes"),
                  health_memory_bytes(body, "rss_bytes"))


def take_sample(proc_root: str | Path, pid: int | None, health: str, now: float | None = None,
                planned_rss: int | None = None, reported_rss: int | None = None) -> Sample:
    from pagedserve.memory.probe import process_start_time

    now = time.time() if now is None else now
    tree = tree_rss = age = None
    pids = process_tree(proc_root, pid) if pid is not None else []
    if pids:
        tree = thread_counts(proc_root, pids)
        tree_rss = sum(rss_bytes(proc_root, p) for p in pids)
        started = process_start_time(Path(proc_root) / str(pid) / "stat", now=now)
        age = None if started is None else now - started
    return Sample(
        time=now,
        load1=read_load1(proc_root),
        system=thread_counts(proc_root, list_pids(proc_root)),
        pid=pid,
        tree=tree,
        tree_rss_bytes=tree_rss,
        health=health,
        planned_rss_bytes=planned_rss,
        reported_rss_bytes=reported_rss,
        age_s=age,
    )


# ----------------------------------------------------------------------------------------------- verdict


def is_rising(series: list[int], window: int = STUCK_WINDOW, threshold: int = STUCK_MIN_BLOCKED) -> bool:
    """The last `window` values never fall, rise overall, and end at or above `threshold`."""
    if len(series) < window:
        return False
    last = series[-window:]
    never_falls = all(b >= a for a, b in zip(last, last[1:]))
    return never_falls and last[-1] > last[0] and last[-1] >= threshold


def classify(samples: list[Sample], num_cpus: int = 1) -> Verdict:
    """STUCK only when D-state threads pile up (never on load alone); DOWN when the watched server is gone or
    /health has not answered for STUCK_WINDOW samples; BUSY for high load; else OK."""
    if not samples:
        return Verdict("OK", "no samples yet")
    series = [("system", [s.system.blocked for s in samples])]
    if all(s.tree is not None for s in samples[-STUCK_WINDOW:]):
        series.insert(0, ("server", [s.tree.blocked if s.tree else 0 for s in samples]))
    for label, blocked in series:
        if is_rising(blocked):
            trail = " -> ".join(str(n) for n in blocked[-STUCK_WINDOW:])
            return Verdict("STUCK", f"{label} D-state threads {trail}: piling up in uninterruptible I/O"
                                    " (memory pressure or a stalled disk; see dmesg, free -h)")
    latest = samples[-1]
    if latest.pid is not None and latest.tree is None:
        return Verdict("DOWN", f"the server (pid {latest.pid}) is gone")
    recent = samples[-STUCK_WINDOW:]
    if len(recent) == STUCK_WINDOW and all(s.health == "unreachable" for s in recent):
        if latest.tree is not None and latest.age_s is not None and latest.age_s < STARTING_GRACE_S:
            return Verdict("OK", f"/health does not answer yet: the server (pid {latest.pid}) started "
                                 f"{latest.age_s:.0f} s ago and opens its port once its imports are done")
        return Verdict("DOWN", f"/health unreachable over the last {STUCK_WINDOW} samples: the server is not "
                               "listening at --url, or does not answer within "
                               f"{HEALTH_TIMEOUT_S:g} s (see its log)")
    d_now = latest.system.blocked
    if d_now >= STUCK_MIN_BLOCKED:
        return Verdict("OK", f"D={d_now} but not rising over {STUCK_WINDOW} samples: waiting on I/O, watch")
    if latest.load1 >= num_cpus and latest.system.running >= num_cpus:
        return Verdict("BUSY", f"load {latest.load1:.2f} on {num_cpus} cores with D={d_now}: computing, not stuck")
    if latest.load1 >= num_cpus:  # the 1-minute average lags: QA-AG saw BUSY a minute after a load had ended
        return Verdict("OK", f"load {latest.load1:.2f} on {num_cpus} cores is the last minute's; "
                             f"R={latest.system.running} now: the load has passed")
    return Verdict("OK", f"load {latest.load1:.2f} on {num_cpus} cores, D={d_now}")


# ----------------------------------------------------------------------------------------------- output


def format_sample(sample: Sample, verdict: Verdict) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(sample.time))
    parts = [clock, f"load={sample.load1:<6.2f}", f"R={sample.system.running:<3} D={sample.system.blocked:<3}"]
    if sample.pid is not None:
        if sample.tree is None:
            parts.append(f"server(pid {sample.pid}): gone")
        else:
            parts.append(f"server R={sample.tree.running:<3} D={sample.tree.blocked:<3} rss={format_rss(sample)}")
    elif sample.reported_rss_bytes:  # no --pid: the server's own reading, from /health
        parts.append(f"server rss={format_rss(sample, sample.reported_rss_bytes)} (its /health; --pid: live)")
    parts += [f"health={sample.health}", verdict.state]
    return "  ".join(parts)


def format_rss(sample: Sample, rss: int | None = None) -> str:
    """"0.95GiB", or against the plan: "0.95GiB/plan 1.10GiB (-14%)" (`rss`: the process tree's by default)."""
    rss = (sample.tree_rss_bytes if rss is None else rss) or 0
    text = f"{rss / GIB:.2f}GiB"
    if sample.planned_rss_bytes:
        text += f"/plan {sample.planned_rss_bytes / GIB:.2f}GiB ({rss / sample.planned_rss_bytes - 1:+.0%})"
    return text


def sample_to_json(sample: Sample, verdict: Verdict) -> str:
    data = asdict(sample)
    data.update(verdict=verdict.state, reason=verdict.reason)
    return json.dumps(data)


# ----------------------------------------------------------------------------------------------- command


def unix_socket_url(url: str) -> tuple[str, object]:
    """(the URL to ask, httpx's transport): a server on --uds is reached as unix:PATH (or unix:///PATH); any other
    URL as it is."""
    import httpx

    from pagedserve.benchmarks.client import server_url, unix_socket_path

    path = unix_socket_path(url)
    return (server_url(url), None) if path is None else ("http://localhost", httpx.HTTPTransport(uds=path))


def watch(args: argparse.Namespace, proc_root: str | Path = "/proc") -> int:
    """Sample every --interval seconds; exit code 1 if the last verdict was STUCK or DOWN (for scripts with
    --count)."""
    from pagedserve.cli.common import fail
    from pagedserve.memory.probe import usable_cpu_count

    if not args.interval >= 0:
        return fail(f"--interval must be a number of seconds >= 0, got {args.interval}")
    if args.count is not None and args.count < 1:
        return fail(f"--count must be >= 1 (or left out: until Ctrl-C), got {args.count}")
    if args.url and not args.url.startswith("unix:"):
        problem = _url_problem(args.url)
        if problem:
            return fail(f"--url {args.url!r}: {problem}; give http(s)://HOST:PORT, unix:PATH, or '' to skip /health")
    num_cpus = usable_cpu_count()
    samples: list[Sample] = []
    verdict = Verdict("OK", "no samples yet")
    previous = None
    import httpx

    url, transport = unix_socket_url(args.url) if args.url else (args.url, None)
    taken = 0
    with httpx.Client(transport=transport) as client:
        while args.count is None or taken < args.count:  # samples keeps only a window: count them apart
            if taken:
                time.sleep(args.interval)
            taken += 1
            health = fetch_health(client, url) if url else Health("-")
            sample = take_sample(proc_root, args.pid, health.text, planned_rss=health.planned_rss_bytes,
                                 reported_rss=health.reported_rss_bytes)
            samples = [*samples[-(STUCK_WINDOW * 4):], sample]
            verdict = classify(samples, num_cpus)
            line = sample_to_json(samples[-1], verdict) if args.json else format_sample(samples[-1], verdict)
            print(line, flush=True)
            if not args.json and (verdict.state != previous or verdict.state in FAULTS):
                print(f"  {verdict.state}: {verdict.reason}", flush=True)  # on changes, not every line
            previous = verdict.state
    return 1 if verdict.state in FAULTS else 0


def _url_problem(text: str) -> str | None:
    """What is wrong with a server URL (None: nothing): not http(s), no host, a port that cannot be."""
    import httpx

    try:
        url = httpx.URL(text)
        port = url.port
    except (httpx.InvalidURL, ValueError) as exc:
        return str(exc) or "not a URL"
    if url.scheme not in ("http", "https") or not url.host:
        return "not an http(s) URL"
    if port is not None and not 0 < port < 65536:
        return f"port {port} is not in 1..65535"
    return None


def run(args: argparse.Namespace) -> int:
    if args.pid is not None and not (Path("/proc") / str(args.pid)).exists():
        print(f"no process with pid {args.pid} (a server that exited? see its log, or `pagedserve watch` without "
              "--pid to watch the whole machine)", file=sys.stderr)
        return 2
    try:
        return watch(args)
    except KeyboardInterrupt:
        return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "watch", help="watch load, R/D threads, RSS and /health: tell busy from stuck",
        description="Print one line per sample: load average, threads running (R) and in uninterruptible I/O"
        " wait (D) system-wide and for the server's process tree, its RSS against what the server's memory plan"
        " expects resident, and its /health phase. STUCK only"
        f" when D-state threads are >= {STUCK_MIN_BLOCKED} and rising over {STUCK_WINDOW} samples; high load"
        " alone is BUSY, not a fault.", formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--pid", type=int, default=None, help="the server's process id (its tree is watched)")
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="server base URL for /health (unix:PATH for a server on --uds; '' to skip)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--count", type=int, default=None, help="stop after N samples (default: until Ctrl-C)")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    parser.set_defaults(func=run)
