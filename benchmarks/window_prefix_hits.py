"""Prefix-cache hits with the sliding-window layers' pool of their own (core/kv_cache_manager.py), against one pool
for every layer: multi-turn chat and a shared system prompt, through the real scheduler and KV manager with made-up
tokens in place of a model (no torch; every configuration sees the same requests at the same steps).

Multi-turn chat: `--conversations` conversations take turns on a server running at most `--max-num-seqs` requests;
each turn's prompt is the conversation so far plus a new message, its answer 40-120 tokens, and the next turn
arrives 20-200 steps after the answer. A turn hits the prefix cache only while the window pool still holds the
window before its history's end, which the turn before freed when it finished. Shared prompt: 64 one-turn requests
whose prompts start with the same 1000 tokens.

For each workload it prints the share of prompt tokens served from the cache (vLLM's prefix-cache hit rate) with
one pool, and with the window pool as the plan sizes it: the running requests' blocks (sizes.window_pool_blocks)
plus 0..3 cached windows per running request (sizes.window_cache_blocks, CACHED_WINDOWS_PER_SEQ; the plan gives
them where the budget has room beside the workload), and with `stale` off (blocks given back mid-request kept as
any cached block); "before" is the window pool as it was, running requests' blocks and plain LRU.

    python benchmarks/window_prefix_hits.py [--block-size 16] [--turns 8]
"""

from __future__ import annotations

import argparse
import random

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import ModelRunnerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.memory import sizes
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 4096
STEP_TOKENS = 256


def hit_rate(window: int, max_num_seqs: int, conversations: int, turns: int, block_size: int,
             cached_windows: int | None, shared: int = 0, seed: int = 0) -> float:
    """The prefix-cache hit rate of the workload; `cached_windows` None: one pool for every layer."""
    rng = random.Random(seed)
    num_blocks = max_num_seqs * -(-MAX_MODEL_LEN // block_size) + 1  # the plan's workload bound
    if cached_windows is None:
        kv = KVCacheManager(num_blocks, block_size, True)
    else:
        per_window = -(-window // block_size) + 1
        num_window = (sizes.window_pool_blocks(window, block_size, max_num_seqs, STEP_TOKENS)
                      + cached_windows * max_num_seqs * per_window + 1)
        kv = KVCacheManager(num_blocks, block_size, True, min(num_blocks, num_window), window)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=STEP_TOKENS,
                             max_model_len=MAX_MODEL_LEN)
    sched = Scheduler(config, kv)
    system = [rng.randrange(1000) for _ in range(shared)]
    history = {c: system + [rng.randrange(1000) for _ in range(40)] for c in range(conversations)}
    turn = dict.fromkeys(range(conversations), 0)
    arrives = {c: rng.randrange(50) for c in range(conversations)}
    running: dict[str, tuple[int, Request]] = {}
    step = 0
    while arrives or sched.has_unfinished_requests():
        for c in [c for c, at in arrives.items() if at <= step]:
            del arrives[c]
            max_tokens = rng.randrange(40, 120)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            request = Request(f"{c}-{turn[c]}", list(history[c]), params, eos_token_id=None, max_tokens=max_tokens)
            sched.add_request(request)
            running[request.request_id] = (c, request)
        step += 1
        if not sched.has_unfinished_requests():
            continue
        out = sched.schedule()
        sampled = {rid: [rng.randrange(1000)] for rid, needs in out.needs_sample.items() if needs}
        sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        for rid, (c, request) in list(running.items()):
            if request.is_finished:
                del running[rid]
                turn[c] += 1
                if turn[c] < turns:
                    message = [rng.randrange(1000) for _ in range(rng.randrange(10, 40))]
                    history[c] = list(request.all_token_ids) + message
                    arrives[c] = step + rng.randrange(20, 200)
    return kv.stats.num_hits / kv.stats.num_queries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    args = parser.parse_args()
    workloads = [("chat", 128, 8, 16, 0), ("chat", 512, 8, 16, 0), ("chat", 128, 8, 24, 0), ("chat", 512, 4, 12, 0),
                 ("chat", 128, 4, 16, 0), ("shared prompt", 128, 8, 64, 1000), ("shared prompt", 512, 8, 64, 1000)]
    print("| workload | window | max-num-seqs | conversations | one pool | before (0 cached, `stale` off) |"
          " window pool + 0 / 1 / 2 / 3 cached windows per running request | + 2, `stale` off |")
    print("|---|---|---|---|---|---|---|---|")
    for name, window, seqs, conversations, shared in workloads:
        turns = args.turns if not shared else 1

        def rate(cached, stale=True, seqs=seqs, window=window, conversations=conversations, shared=shared,
                 turns=turns):
            free_blocks = BlockPool.free_blocks
            if not stale:
                BlockPool.free_blocks = lambda self, blocks, stale=False: free_blocks(self, blocks)
            try:
                return hit_rate(window, seqs, conversations, turns, args.block_size, cached, shared)
            finally:
                BlockPool.free_blocks = free_blocks

        pooled = " / ".join(f"{rate(n):.2f}" for n in range(4))
        print(f"| {name} | {window} | {seqs} | {conversations} | {rate(None):.2f} | {rate(0, stale=False):.2f} |"
              f" {pooled} | {rate(sizes.CACHED_WINDOWS_PER_SEQ, stale=False):.2f} |")

if __name__ == "__main__":
    main()
