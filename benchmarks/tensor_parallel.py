"""Tensor parallelism on this box: TP=2 against TP=1, W1 and W2 of compare.py, all-reduce time per step.

    python benchmarks/tensor_parallel.py [--model DIR] [--rounds 2] [--quick] [--systems tp1,tp2,...]

Systems (each in its own long-lived process, taking turns per round so the box's drift hits all alike):
  tp1      one process, all usable cores (the default server)
  tp1-1t   one process, one thread: the compute one rank gets
  tp2      -tp 2, one rank per core, shared-memory collectives
  tp2-gloo -tp 2 with gloo's TCP collectives (what the shared-memory path replaces)

Each run reports output tok/s from counted tokens, engine steps, and per step the time spent inside the
collectives (all-reduces after o and down, the embedding's, the logits all-gather), which includes waiting
for the other rank. Results: benchmarks/out/tensor_parallel/<timestamp>.json and a table on stdout;
RESULTS_tensor_parallel.md reads them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import (FULL_WORKLOADS, QUICK_WORKLOADS, ContentionMeter, Worker, make_prompts,  # noqa: E402
                     prompt_pool, prompt_rng)
from comparison.children import stop_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parent
DEFAULT_MODEL = ROOT / "out" / "models" / "qwen2.5-0.5b-shape-random"
PROTOCOL_PREFIX = "@@compare "  # compare.Worker reads lines with this prefix
SYSTEMS = {"tp1": dict(tensor_parallel_size=1), "tp1-1t": dict(tensor_parallel_size=1, num_threads=1),
           "tp2": dict(tensor_parallel_size=2), "tp2-gloo": dict(tensor_parallel_size=2, tp_all_reduce="gloo")}


class TPRunner:
    """One system's engine; counts steps and collective time around each run."""

    def __init__(self, system: str, model: str, max_model_len: int) -> None:
        from pagedserve import LLM

        self.llm = LLM(model, dtype="bfloat16", max_model_len=max_model_len, seed=0, **SYSTEMS[system])  # as compare.py
        self.num_steps = 0
        engine = self.llm.engine
        step = engine.step

        def counted_step() -> Any:
            self.num_steps += 1
            return step()

        engine.step = counted_step
        self.group = getattr(engine.runner, "group", None)

    def run(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        from pagedserve.benchmarks.throughput import ThroughputBenchConfig, time_generate

        steps, stats = self.num_steps, self.group.stats if self.group else None
        calls, seconds = (stats.num_calls, stats.seconds) if stats else (0, 0.0)
        run = time_generate(self.llm, prompts, [output_len] * len(prompts), ThroughputBenchConfig())
        num_steps = self.num_steps - steps
        collective_s = (stats.seconds - seconds) if stats else 0.0
        return {"elapsed_s": run.elapsed_s, "num_output_tokens": run.num_output_tokens,
                "num_prompt_tokens": run.num_prompt_tokens, "num_steps": num_steps,
                "collective_calls": (stats.num_calls - calls) if stats else 0, "collective_s": collective_s}


def _rss_per_rank() -> list[float]:
    """Resident memory of this process (rank 0) and of its children (the other ranks), MiB."""
    import psutil

    me = psutil.Process()
    ranks = [c for c in me.children() if "spawn_main" in " ".join(c.cmdline())]  # not the resource tracker
    return [round(p.memory_info().rss / 2**20) for p in [me, *ranks]]


def worker_main(system: str, model: str, max_model_len: int) -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(payload: dict[str, Any]) -> None:
        protocol.write(PROTOCOL_PREFIX + json.dumps(payload) + "\n")

    start = time.perf_counter()
    try:
        runner = TPRunner(system, model, max_model_len)
    except Exception as exc:  # reported to the orchestrator as this system's failure
        reply({"ok": False, "error": f"load failed: {type(exc).__name__}: {exc}"})
        return 1
    import torch

    reply({"ok": True, "load_s": time.perf_counter() - start, "threads": torch.get_num_threads(),
           "collectives": runner.group.kind if runner.group else None, "rss_mib_per_rank": _rss_per_rank()})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            reply({"ok": True})
            if runner.group is not None:
                runner.llm.engine.runner.close()
            return 0
        try:
            reply({"ok": True, **runner.run(command["prompts"], command["output_len"])})
        except Exception as exc:
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


class SystemWorker(Worker):
    """compare.Worker's protocol, started on this script."""

    def __init__(self, system: str, model: str, max_model_len: int, log_dir: Path) -> None:
        self.system = system
        self.log_path = log_dir / f"worker-{system}.log"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--model", model,
                   "--max-model-len", str(max_model_len)]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            text=True, bufsize=1, start_new_session=True)
        self.hello = self._read()


def summarize(runs: list[dict[str, Any]]) -> list[str]:
    """One markdown row per (workload, system): tok/s per round, mean, ms per step, collectives per step."""
    rows = ["| workload | system | output tok/s (rounds) | mean | ms/step | collectives ms/step (calls) | share |",
            "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["workload"], r["system"]) for r in runs}, key=lambda k: (k[0], list(SYSTEMS).index(k[1])))
    for workload, system in keys:
        mine = [r for r in runs if r["workload"] == workload and r["system"] == system and r.get("ok")]
        if not mine:
            continue
        rates = [r["num_output_tokens"] / r["elapsed_s"] for r in mine]
        steps = sum(r["num_steps"] for r in mine)
        step_ms = 1000 * sum(r["elapsed_s"] for r in mine) / steps
        coll_ms = 1000 * sum(r["collective_s"] for r in mine) / steps
        calls = sum(r["collective_calls"] for r in mine) / steps
        rows.append(f"| {workload} | {system} | {' / '.join(f'{x:.1f}' for x in rates)} | "
                    f"{sum(rates) / len(rates):.1f} | {step_ms:.1f} | {coll_ms:.2f} ({calls:.0f}) | "
                    f"{coll_ms / step_ms:.0%} |")
    return rows


COLLECTIVE_SHAPES = ((1, 896), (32, 896), (128, 896))  # hidden rows of W1 decode, W2 decode, a prefill chunk


def collectives_rank(rank: int, address: Any, iterations: int, queue: Any) -> None:
    """One rank of the collectives microbenchmark: all-reduce latency per shape (bf16), one thread."""
    import torch

    from pagedserve.distributed.group import TPGroup

    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, [cores[rank % len(cores)]])
    group = TPGroup(rank, 2)
    group.connect(address)
    for shape in COLLECTIVE_SHAPES:
        x = torch.ones(shape, dtype=torch.bfloat16)
        for _ in range(20):
            group.all_reduce(x.fill_(1.0))
        start = time.perf_counter()
        for _ in range(iterations):
            group.all_reduce(x)
        if rank == 0:
            queue.put({"path": "shm" if address.shm_path else "gloo", "shape": list(shape),
                       "us_per_call": 1e6 * (time.perf_counter() - start) / iterations})
    group.close()


def measure_collectives(iterations: int) -> list[dict[str, Any]]:
    """Shared-memory vs gloo all-reduce between two spawned processes, one core each (this process keeps its
    affinity: the systems' workers inherit it)."""
    import datetime as dt
    import multiprocessing
    import tempfile

    import torch.distributed as dist

    from pagedserve.distributed import shm
    from pagedserve.distributed.group import GroupAddress

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    results = []
    for use_shm in (True, False):
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                              timeout=dt.timedelta(seconds=60))
        path = tempfile.mktemp(prefix="pagedserve-tp-bench-", dir="/dev/shm") if use_shm else None
        if path:
            shm.create_segment(path, 2)
        address = GroupAddress("127.0.0.1", store.port, path, "gloo", 60.0)
        peers = [context.Process(target=collectives_rank, args=(rank, address, iterations, queue)) for rank in (0, 1)]
        for peer in peers:
            peer.start()
        for peer in peers:
            peer.join()
        if path:
            os.unlink(path)
        results += [queue.get() for _ in COLLECTIVE_SHAPES]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="compare.py's quick workloads")
    parser.add_argument("--systems", default="tp1,tp1-1t,tp2,tp2-gloo")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--collectives", type=int, default=2000, metavar="N",
                        help="iterations of the all-reduce microbenchmark (0: skip it)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker, args.model, args.max_model_len)
    stop_on_sigterm()  # so that the `finally` below closes the workers (and their ranks)
    collectives = measure_collectives(args.collectives) if args.collectives else []
    for row in collectives:
        print(f"all-reduce {row['path']:4s} bf16 {row['shape']}: {row['us_per_call']:.1f} us per call", flush=True)
    systems = args.systems.split(",")
    workloads = [w for w in (QUICK_WORKLOADS if args.quick else FULL_WORKLOADS) if w.name in args.workloads.split(",")]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = ROOT / "out" / "tensor_parallel" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    pool = prompt_pool(args.model)
    meter = ContentionMeter()
    workers: dict[str, SystemWorker] = {}
    runs = []
    try:
        for s in systems:
            workers[s] = SystemWorker(s, args.model, args.max_model_len, out_dir)
        hellos = {s: w.hello for s, w in workers.items()}
        print(json.dumps(hellos, indent=1), flush=True)
        for round_index in range(args.rounds + 1):  # round 0 warms every system up and is not reported
            order = systems[round_index % len(systems):] + systems[:round_index % len(systems)]
            for workload in workloads:
                prompts = make_prompts(pool, workload, prompt_rng(0, workload.name, round_index))
                for system in order:
                    result = workers[system].call({"op": "run", "prompts": prompts,
                                                   "output_len": workload.output_len})
                    record = {"round": round_index, "workload": workload.name, "system": system, **result}
                    print(json.dumps(record), flush=True)
                    if round_index > 0:
                        runs.append(record)
    finally:
        for worker in workers.values():
            worker.close()
    contention = meter.stop()
    table = summarize(runs)
    print("\n".join(table))
    print(f"other processes used {contention['others_cpu_share']:.0%} of the CPU during the run")
    (out_dir / "results.json").write_text(json.dumps({"hellos": hellos, "runs": runs, "contention": contention,
                                                      "collectives": collectives,
                                                      "table": table, "model": args.model}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
