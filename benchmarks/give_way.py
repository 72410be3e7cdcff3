"""Batch-1 decode next to a busy neighbour, with the engine giving way (--cpu-give-way) and without.

Fresh processes taking turns (the order flips every round): for each neighbour (none, one or two busy Python loops, a
torch process running 2-thread matmuls), started 1 s before, `LLM(MODEL, cpu_give_way=on/off)` generates 4 requests
of 32 greedy tokens and prints each request's tok/s and the thread count it ended on. The first request runs before
two readings of engine/cpu_share.py have agreed.

    python benchmarks/give_way.py [MODEL] [--rounds 2] [--spin 3000] [--only NEIGHBOUR]

--spin sets GOMP_SPINCOUNT in the children (3000 is `pagedserve serve`'s default wait; leave it out for libgomp's own,
what an `LLM(...)` process gets).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from comparison.children import run as run_child, stop, stop_on_sigterm  # (this script's folder is on sys.path)

CHILD = r'''
import json, sys, time
from pagedserve import LLM, SamplingParams
import torch
llm = LLM(sys.argv[1], max_model_len=1024, cpu_give_way=sys.argv[2] == "on")
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
rates, deadline = [], time.monotonic() + 60
for _ in range(4):
    start = time.perf_counter()
    llm.generate(["Tell me about the sea."], params)
    rates.append(32 / (time.perf_counter() - start))
    if time.monotonic() > deadline:
        break
print(json.dumps({"rates": rates, "threads": torch.get_num_threads()}))
'''
BUSY = [sys.executable, "-c", "while True: pass"]
TORCH = [sys.executable, "-c", "import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\nwhile True: a @ a"]
NEIGHBOURS = {"none": [], "one busy loop": [BUSY], "two busy loops": [BUSY, BUSY], "torch 2 threads": [TORCH]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spin", help="GOMP_SPINCOUNT of the children")
    parser.add_argument("--only", choices=sorted(NEIGHBOURS))
    args = parser.parse_args()
    stop_on_sigterm()
    env = dict(os.environ, **({"GOMP_SPINCOUNT": args.spin} if args.spin else {}))
    for r in range(args.rounds):
        for name, commands in NEIGHBOURS.items():
            if args.only and name != args.only:
                continue
            neighbours = [subprocess.Popen(command, start_new_session=True) for command in commands]
            time.sleep(1.0)
            try:
                for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    try:
                        out = run_child([sys.executable, "-c", CHILD, args.model, mode], timeout=120, env=env)
                        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
                        result = json.loads(lines[-1]) if lines else {"rates": [], "error": out.stderr[-300:]}
                    except subprocess.TimeoutExpired:
                        result = {"rates": [], "error": "timed out after 120 s"}
                    rates = ", ".join(f"{rate:.1f}" for rate in result["rates"])
                    print(f"round {r}, neighbour {name}, give way {mode}: [{rates}] tok/s, "
                          f"{result.get('threads')} threads at the end {result.get('error', '')}", flush=True)
            finally:
                for process in neighbours:
                    stop(process, grace=0)


if __name__ == "__main__":
    main()
