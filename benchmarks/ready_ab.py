"""Process start -> /health 200 of `pagedserve serve MODEL`, an older commit against the working tree, taking turns.

Start-up changes are measured against the commit before them in one run, fresh processes alternating (the
order flips every round), because this VM's speed drifts from minute to minute. The older commit is checked
out as a git worktree (`git worktree add /tmp/oldtree COMMIT`) and run with PYTHONPATH pointing at it. Both
trees' modules are byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (as on this project's VMs) a tree
without bytecode compiles every module at every start (~0.3 s), which would be measured as start-up.

    python benchmarks/ready_ab.py --before /tmp/oldtree MODEL [MODEL ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from comparison.children import run as run_child, stop, stop_on_sigterm  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ready_seconds(tree: Path, model: str, timeout: float = 120.0) -> float:
    """Seconds from starting the server in `tree` to its first /health 200; the server is then stopped."""
    port = free_port()
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", model, "--host", "127.0.0.1",
                             "--port", str(port)], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while time.monotonic() - start < timeout:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"the server in {tree} exited with {proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError(f"the server in {tree} was not ready within {timeout:.0f} s")
    finally:
        stop(proc)


def prepare_trees(before: Path, after: Path) -> dict[str, Path]:
    """{"before": ..., "after": ...}, resolved; says which commit each holds (a stale folder of that name is not
    the commit) and byte-compiles both (see the top)."""
    trees = {"before": before.resolve(), "after": after.resolve()}
    for name, tree in trees.items():
        head = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True,
                              text=True).stdout.strip()
        print(f"{name}: {tree} at {head[:72] or 'no git checkout'}", flush=True)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "pagedserve")], check=True,
                       stdout=subprocess.DEVNULL)
    return trees


def run_in_tree(tree: Path, code: str, *args: str, env: dict[str, str] | None = None) -> object:
    """Run `code` (python -c, args after it) in a fresh process importing pagedserve from `tree`, with `env` added to
    the environment; the JSON it printed on its last "RESULT " line."""
    out = run_child([sys.executable, "-c", code, *args], cwd="/tmp",
                    env={**os.environ, **(env or {}), "PYTHONPATH": str(tree)})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"the run in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def in_turns(contenders: dict, index: int) -> list[tuple]:
    """(name, contender) pairs in round `index`'s order: flipped every round, so neither always runs first."""
    return list(contenders.items()) if index % 2 == 0 else list(reversed(contenders.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="models to serve (names or paths)")
    parser.add_argument("--before", type=Path, required=True, help="worktree of the older commit")
    parser.add_argument("--after", type=Path, default=REPO, help="tree to compare (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    stop_on_sigterm()
    trees = prepare_trees(args.before, args.after)
    # Servers run inside their trees: a local path is made absolute, a known name stays a name.
    args.models = [str(Path(m).resolve()) if Path(m).exists() else m for m in args.models]
    for model in args.models:  # builds each tree's kernels and warms the page cache; not counted
        for tree in trees.values():
            ready_seconds(tree, model)
    results: dict[tuple[str, str], list[float]] = {}
    for index in range(args.rounds):
        for model in args.models:
            for name, tree in in_turns(trees, index):
                seconds = ready_seconds(tree, model)
                results.setdefault((model, name), []).append(seconds)
                print(f"round {index + 1} {Path(model).name} {name}: {seconds:.2f} s", flush=True)
    for (model, name), times in results.items():
        print(f"{Path(model).name} {name} ({trees[name]}): median {statistics.median(times):.2f} s "
              f"({' '.join(f'{t:.2f}' for t in times)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
