"""Decode speed by --kv-cache-dtype, interleaved: fresh processes take turns, each timing one request at 1000 positions
and 6 requests at 300 (64 greedy decode steps each, the prefill timed apart), so that this VM's drift hits every
configuration alike. `--before DIR`: also run another checkout's code (its pagedserve on PYTHONPATH) with fp8, e.g. a
clean clone of an older commit.

    python benchmarks/kv_cache_dtype.py benchmarks/out/models/qwen2.5-0.5b-shape-random --rounds 3

(The model: any HF directory; `benchmarks/speculative.py` builds the 0.5B shape there.) 2026-12-06, 2 cores of a Zen 4,
bf16 weights: fp8 0.81-1.5x auto's steps/s a round (level within the drift); against the code before the native fp8
path (torch ops wrote the pool, SDPA read it) 2.3-2.8x at one request and 3.2-5.0x at 6.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from comparison.children import run as run_child, stop_on_sigterm  # (this script's folder is on sys.path)

WORKLOADS = {"1 x 1000": (1, 1000), "6 x 300": (6, 300)}


def measure(model: str, kv_cache_dtype: str) -> dict[str, float]:
    """In this process: decode steps a second for each workload."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", max_model_len=2048, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)

    def run(prompts: list[list[int]], tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0))
        return time.perf_counter() - start

    run([[5] * 50], 4)  # warm
    result = {}
    for name, (count, length) in WORKLOADS.items():
        prompts = [[(37 * j + 11 * i) % 5000 + 10 for j in range(length)] for i in range(count)]
        prefill = run(prompts, 1)
        result[name] = 64 / (run(prompts, 65) - prefill)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="another checkout whose code also runs, with fp8")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    stop_on_sigterm()
    configs = [("auto", None), ("fp8", None)] + ([("fp8", args.before)] if args.before else [])
    for round_ in range(1, args.rounds + 1):
        steps = {}
        for kv, checkout in configs:
            env = dict(os.environ, **({"PYTHONPATH": checkout} if checkout else {}))
            out = run_child([sys.executable, __file__, args.model, "--child", args.model, kv], env=env,
                            check=True).stdout
            steps[kv if checkout is None else f"{kv} (before)"] = json.loads(out.strip().splitlines()[-1])
        for name in WORKLOADS:
            auto = steps["auto"][name]
            print(f"round {round_}, {name}: " + ", ".join(f"{label} {s[name]:.1f} steps/s ({s[name] / auto:.2f}x)"
                                                          for label, s in steps.items()), flush=True)


if __name__ == "__main__":
    main()
