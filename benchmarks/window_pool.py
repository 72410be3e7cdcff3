"""The sliding-window layers' KV pool of their own (core/kv_cache_manager.py) against one pool for every layer
(--disable-hybrid-kv-cache-manager): what the plan sets aside for the KV cache, what a workload writes in it, the
process's RSS after it, and the workload's decode rate.

Fresh processes taking turns (the order flips every round): `LLM(MODEL, max_model_len, max_num_seqs)` prefills
--sequences random prompts of --context tokens and decodes --tokens greedy tokens each, then prints the KV blocks
written in each pool, their bytes, the plan's KV pool bytes, VmRSS and the decode tok/s (the model runner's
decode-only steps: their rows over their time, so the prefill's drift does not leak in). A model whose layers have
no window has no window pool: both arms are then the same.

    python benchmarks/window_pool.py MODEL [--context 6000] [--sequences 2] [--tokens 32] [--max-model-len 8192]
        [--max-num-seqs 4] [--dtype bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from comparison.children import run as run_child, stop_on_sigterm  # (this script's folder is on sys.path)

CHILD = r"""
import json, random, sys, time
from pagedserve import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(args["model"], dtype=args["dtype"], max_model_len=args["max_model_len"], max_num_seqs=args["max_num_seqs"],
          disable_hybrid_kv_cache_manager=args["disabled"])
def prompts(seed):
    r = random.Random(seed)
    return [{"prompt_token_ids": [r.randrange(1000, 30000) for _ in range(args["context"])]}
            for _ in range(args["sequences"])]
engine = llm.llm_engine
execute, decodes = engine.runner.execute, []
def timed(sched):  # the model runner's decode-only steps: (seconds, rows)
    start = time.perf_counter()
    out = execute(sched)
    if sched.num_scheduled_tokens and all(n == 1 for n in sched.num_scheduled_tokens.values()):
        decodes.append((time.perf_counter() - start, len(sched.num_scheduled_tokens)))
    return out
engine.runner.execute = timed
llm.generate(prompts(1), SamplingParams(temperature=0.0, max_tokens=args["tokens"], ignore_eos=True))
plan, kv = engine.config.memory_plan, engine.kv
written = kv.num_blocks_written * plan.block_bytes + kv.num_window_blocks_written * plan.window_block_bytes
rss = int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024
print(json.dumps({"main_blocks_written": kv.num_blocks_written, "window_blocks_written": kv.num_window_blocks_written,
                  "kv_written_bytes": written, "planned_kv_bytes": plan.kv_pool_bytes, "rss_bytes": rss,
                  "decode_tok_s": sum(rows for _, rows in decodes) / sum(t for t, _ in decodes)}))
"""

MIB = 1 << 20


def run(args: argparse.Namespace, disabled: bool) -> dict:
    settings = {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
                "max_num_seqs": args.max_num_seqs, "context": args.context, "sequences": args.sequences,
                "tokens": args.tokens, "disabled": disabled}
    done = run_child([sys.executable, "-c", CHILD, json.dumps(settings)], cwd=Path(__file__).resolve().parent.parent,
                     check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=6000)
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    stop_on_sigterm()
    for round_index in range(args.rounds):
        order = (False, True) if round_index % 2 == 0 else (True, False)
        for disabled in order:
            r = run(args, disabled)
            name = "one pool   " if disabled else "window pool"
            print(f"round {round_index + 1} {name}: KV written {r['kv_written_bytes'] / MIB:.0f} MiB "
                  f"({r['main_blocks_written']} + {r['window_blocks_written']} blocks), planned KV "
                  f"{r['planned_kv_bytes'] / MIB:.0f} MiB, RSS {r['rss_bytes'] / MIB:.0f} MiB, "
                  f"decode {r['decode_tok_s']:.1f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
