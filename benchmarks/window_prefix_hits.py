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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Workload:
    name: str
    window: int
    max_num_seqs: int
    conversations: int
    turns: int = 8
    shared: int = 0  # tokens every prompt opens with (a system prompt)
    document: int = 0  # tokens of a conversation's own document: each turn asks about it anew (no history)
    gap: int = 0  # steps between the conversations' first turns (0: all within 50 steps)


def hit_rate(load: Workload, block_size: int, cached_windows: int | None, seed: int = 0) -> float:
    """The prefix-cache hit rate of the workload; `cached_windows` None: one pool for every layer."""
    rng = random.Random(seed)
    num_blocks = load.max_num_seqs * -(-MAX_MODEL_LEN // block_size) + 1  # the plan's workload bound
    if cached_windows is None:
        kv = KVCacheManager(num_blocks, block_size, True)
    else:
        per_window = -(-load.window // block_size) + 1
        num_window = (sizes.window_pool_blocks(load.window, block_size, load.max_num_seqs, STEP_TOKENS)
                      + cached_windows * load.max_num_seqs * per_window + 1)
        kv = KVCacheManager(num_blocks, block_size, True, min(num_blocks, num_window), load.window)
    config = SchedulerConfig(max_num_seqs=load.max_num_seqs, max_num_batched_tokens=STEP_TOKENS,
                             max_model_len=MAX_MODEL_LEN)
    sched = Scheduler(config, kv)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000) for _ in range(n)]

    system = tokens(load.shared)
    documents = {c: tokens(load.document) for c in range(load.conversations)}
    prompts = {c: system + documents[c] + tokens(40) for c in range(load.conversations)}
    turn = dict.fromkeys(range(load.conversations), 0)
    arrives = {c: c * load.gap if load.gap else rng.randrange(50) for c in range(load.conversations)}
    running: dict[str, tuple[int, Request]] = {}
    step = 0
    while arrives or sched.has_unfinished_requests():
        for c in [c for c, at in arrives.items() if at <= step]:
            del arrives[c]
            max_tokens = rng.randrange(40, 120)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            request = Request(f"{c}-{turn[c]}", list(prompts[c]), params, eos_token_id=None, max_tokens=max_tokens)
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
                if turn[c] < load.turns:
                    message = tokens(rng.randrange(10, 40))
                    prompts[c] = (system + documents[c] if load.document else list(request.all_token_ids)) + message
                    arrives[c] = step + rng.randrange(20, 200)
    return kv.stats.num_hits / kv.stats.num_queries


WORKLOADS = [Workload("chat", 128, 8, 16), Workload("chat", 512, 8, 16), Workload("chat", 128, 8, 24),
             Workload("chat", 512, 4, 12), Workload("chat", 128, 4, 16),
             Workload("shared prompt, together", 128, 8, 64, turns=1, shared=1000),
             Workload("shared prompt, together", 512, 8, 64, turns=1, shared=1000),
             Workload("shared prompt, one at a time", 128, 1, 24, turns=1, shared=1000, gap=300),
             Workload("shared prompt, one at a time", 512, 2, 24, turns=1, shared=1000, gap=300),
             Workload("a document asked about 3 times", 128, 4, 8, turns=3, document=1000),
             Workload("a document asked about 3 times", 512, 2, 8, turns=3, document=1500)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    print("| workload | window | max-num-seqs | conversations | one pool | before: running requests' blocks, one"
          " tier | window pool + 0 / 1 / 2 / 3 cached windows per running request | + 2, no shared windows |"
          " + 2, one tier |")
    print("|---|---|---|---|---|---|---|---|---|")
    for load in WORKLOADS:
        def rate(cached: int | None, variant: str = "", load: Workload = load) -> float:
            """variant: "one tier" every block freed into the last tier; "no shared" no window kept as a shared
            prefix's."""
            free_blocks, count_hit_end = BlockPool.free_blocks, KVCacheManager._count_hit_end
            if variant == "one tier":
                BlockPool.free_blocks = lambda self, blocks, tier=0: free_blocks(self, blocks)
            if variant == "no shared":
                KVCacheManager._count_hit_end = lambda self, blocks: None
            try:
                return hit_rate(load, args.block_size, cached)
            finally:
                BlockPool.free_blocks, KVCacheManager._count_hit_end = free_blocks, count_hit_end

        pooled = " / ".join(f"{rate(n):.2f}" for n in range(4))
        kept = sizes.CACHED_WINDOWS_PER_SEQ
        print(f"| {load.name} | {load.window} | {load.max_num_seqs} | {load.conversations} | {rate(None):.2f} |"
              f" {rate(0, 'one tier'):.2f} | {pooled} | {rate(kept, 'no shared'):.2f} |"
              f" {rate(kept, 'one tier'):.2f} |")

if __name__ == "__main__":
    main()
