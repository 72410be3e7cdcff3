"""Prefix-cache hits with the sliding-window layers' pool of their own (core/kv_cache_manager.py), against one pool
for every layer, through the real scheduler and KV manager with made-up tokens in place of a model (no torch; every
configuration sees the same requests at the same steps; the main pool at the plan's workload bound).

- Multi-turn chat: conversations take turns on a server running at most max-num-seqs requests; each turn's prompt
  is the conversation so far plus a new message, its answer 40-120 tokens, and the next turn arrives 20-200 steps
  after the answer. A turn hits past the window only while the window pool still holds the window its last turn
  freed when it finished.
  Re-tokenized: the next turn's history ends the last answer with other tokens from up to 8/40 tokens before its
  end (a template that trims it, or its text tokenized anew) or from anywhere in it.
- Shared prompt: one-turn requests opening with the same 1000 tokens and a message of 40 tokens, all within 50
  steps or one every 300 steps; or with a message longer than the window, one every 100 steps.
- A document: each conversation asks three questions, one after another, about its own document (each prompt the
  document and a new question: a hit needs the window before the document's end).

For each workload it prints the share of prompt tokens served from the cache (vLLM's prefix-cache hit rate) with
one pool, and with the window pool as the plan sizes it: the running requests' blocks (sizes.window_pool_blocks)
plus 0 / 2 / 4 / 6 cached windows per running request (sizes.window_cache_blocks, CACHED_WINDOWS_PER_SEQ; the
plan gives them where the budget has room beside the workload), and without each of the KV manager's rules for
the blocks a running request leaves behind (KVCacheManager._give_back); "before" is the window pool as it was,
the running requests' blocks and one LRU order.

    python benchmarks/window_prefix_hits.py [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_pool import BlockPool
from pagedserve.core import kv_cache_manager
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
    retokenized: int = 0  # the next turn's history ends its last answer with up to this many other tokens
    first_message: int = 40  # tokens of a conversation's first message (after the shared prompt or document)


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
    prompts = {c: system + documents[c] + tokens(load.first_message) for c in range(load.conversations)}
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
                    history = list(request.all_token_ids)
                    if load.retokenized:  # a template that trims the answer, or its text tokenized anew
                        cut = rng.randrange(1, load.retokenized + 1)
                        history = history[:-cut] + tokens(rng.randrange(cut + 1))
                    prompts[c] = (system + documents[c] if load.document else history) + message
                    arrives[c] = step + rng.randrange(20, 200)
    return kv.stats.num_hits / kv.stats.num_queries


WORKLOADS = [Workload("chat", 128, 8, 16), Workload("chat", 512, 8, 16), Workload("chat", 128, 8, 24),
             Workload("chat", 512, 4, 12), Workload("chat", 128, 4, 16),
             Workload("chat, answers re-tokenized at their end", 128, 8, 16, retokenized=8),
             Workload("chat, answers re-tokenized at their end", 512, 4, 12, retokenized=40),
             Workload("chat, answers re-tokenized from anywhere", 128, 8, 16, retokenized=120),
             Workload("chat, answers re-tokenized from anywhere", 512, 4, 12, retokenized=120),
             Workload("shared prompt, together", 128, 8, 64, turns=1, shared=1000),
             Workload("shared prompt, together", 512, 8, 64, turns=1, shared=1000),
             Workload("shared prompt, one at a time", 128, 1, 24, turns=1, shared=1000, gap=300),
             Workload("shared prompt, one at a time", 512, 2, 24, turns=1, shared=1000, gap=300),
             Workload("shared prompt, long messages", 128, 2, 24, turns=1, shared=1000, gap=100, first_message=400),
             Workload("shared prompt, long messages", 512, 4, 24, turns=1, shared=1000, gap=100, first_message=1200),
             Workload("a document asked about 3 times", 128, 4, 8, turns=3, document=1000),
             Workload("a document asked about 3 times", 512, 4, 8, turns=3, document=1500)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    kept = sizes.CACHED_WINDOWS_PER_SEQ
    print("| workload | window | max-num-seqs | conversations | one pool | before: running requests' blocks, one"
          f" tier | window pool + 0 / 2 / 4 / 6 cached windows per running request | + {kept}, no shared windows |"
          f" + {kept}, no prompt-tail tier | + {kept}, no cap on the last tier | + {kept}, one tier |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for load in WORKLOADS:
        def rate(cached: int | None, variant: str = "", load: Workload = load) -> float:
            """variant: "one tier" every block freed into the last tier; "no shared" no window kept as a shared
            prefix's; "no tail" the window before a prompt's end left behind as any other block; "no cap" the
            last tier as large as it grows."""
            saved = (BlockPool.free_blocks, KVCacheManager._count_hit_end, kv_cache_manager._PROMPT_TAIL_TIER,
                     KVCacheManager.__init__)
            if variant == "one tier":
                BlockPool.free_blocks = lambda self, blocks, tier=0: saved[0](self, blocks)
            if variant == "no shared":
                KVCacheManager._count_hit_end = lambda self, blocks: None
            if variant == "no tail":
                kv_cache_manager._PROMPT_TAIL_TIER = kv_cache_manager._LEFT_BEHIND_TIER
            if variant == "no cap":
                def uncapped(self, *args, **kwargs):
                    saved[3](self, *args, **kwargs)
                    if self.window_pool is not None:
                        self.window_pool.last_tier_cap = None
                KVCacheManager.__init__ = uncapped
            try:
                return hit_rate(load, args.block_size, cached)
            finally:
                (BlockPool.free_blocks, KVCacheManager._count_hit_end, kv_cache_manager._PROMPT_TAIL_TIER,
                 KVCacheManager.__init__) = saved

        pooled = " / ".join(f"{rate(n):.2f}" for n in (0, 2, 4, 6))
        variants = " | ".join(f"{rate(kept, v):.2f}" for v in ("no shared", "no tail", "no cap", "one tier"))
        print(f"| {load.name} | {load.window} | {load.max_num_seqs} | {load.conversations} | {rate(None):.2f} |"
              f" {rate(0, 'one tier'):.2f} | {pooled} | {variants} |")

if __name__ == "__main__":
    main()
