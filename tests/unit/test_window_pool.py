"""The sliding-window layers' KV pool of their own (core/kv_cache_manager.py) with fake model outputs (no torch):
a request holds window blocks only for what its next tokens can see, every position a step attends to is in a
block the request holds, prefix hits need the window's blocks, and nothing leaks."""

from __future__ import annotations

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.memory import sizes
from pagedserve.memory.sizes import window_cache_blocks, window_pool_blocks
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

BS = 4


def make_scheduler(window=10, num_blocks=64, num_window_blocks=None, max_num_seqs=4, budget=16, caching=True):
    if num_window_blocks is None:
        num_window_blocks = window_pool_blocks(window, BS, max_num_seqs, budget) + 1
    kv = KVCacheManager(num_blocks, BS, caching, num_window_blocks, window)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256)
    return Scheduler(config, kv)


def make_request(rid, prompt, max_tokens=4) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(prompt), sp, eos_token_id=None, max_tokens=max_tokens)


class FakeRunner:
    """Keeps both block tables as the model runner does (appending what each step adds) and checks, every step,
    that each position a scheduled token attends to is in a block its request holds: the main table's for the
    whole context, the window table's for the last `window` positions."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.tables: dict[str, list[int]] = {}
        self.window_tables: dict[str, list[int]] = {}

    def step(self, out: SchedulerOutput) -> ModelRunnerOutput:
        kv = self.sched.kv
        for new in out.new_requests:
            assert len(new.window_block_ids) == len(new.block_ids)
            self.tables[new.request_id] = list(new.block_ids)
            self.window_tables[new.request_id] = list(new.window_block_ids)
        for cached in out.cached_requests:
            assert len(cached.new_window_block_ids) == len(cached.new_block_ids)
            self.tables[cached.request_id] += cached.new_block_ids
            self.window_tables[cached.request_id] += cached.new_window_block_ids
        computed = {n.request_id: n.num_computed_tokens for n in out.new_requests}
        computed.update((c.request_id, c.num_computed_tokens) for c in out.cached_requests)
        for rid, num in out.num_scheduled_tokens.items():
            start, end = computed[rid], computed[rid] + num
            held = kv.req_to_blocks[rid]
            window_held = kv.req_to_window_blocks[rid]
            for block in range(-(-end // BS)):
                assert self.tables[rid][block] == held[block].block_id and held[block].ref_cnt >= 1
            for block in range(max(0, start - kv.window + 1) // BS, -(-end // BS)):
                entry = window_held[block]
                assert entry is not kv.window_pool.null_block and entry.ref_cnt >= 1, (rid, block, start, end)
                assert self.window_tables[rid][block] == entry.block_id
            # What the request holds in the window pool: about its window and this step's tokens.
            owned = [b for b in window_held if b is not kv.window_pool.null_block]
            assert len(owned) <= -(-(kv.window - 1 + num) // BS) + 1, (rid, len(owned), start, end)
        sampled = {rid: [sum(self.sched.requests[rid].all_token_ids) % 97]
                   for rid, need in out.needs_sample.items() if need}
        return ModelRunnerOutput(sampled_token_ids=sampled)


def run(sched: Scheduler, max_steps=2000) -> dict[str, list[int]]:
    runner, results = FakeRunner(sched), {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for o in sched.update_from_output(out, runner.step(out)):
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
        kv = sched.kv
        for request in sched.running:  # between steps: nothing held before its next token's window
            first = max(0, request.num_computed_tokens - kv.window + 1) // BS
            held = kv.req_to_window_blocks[request.request_id]
            assert all(b is kv.window_pool.null_block for b in held[:first]), (request.request_id, first)
    assert not sched.has_unfinished_requests()
    return results


def assert_no_leaks(sched: Scheduler) -> None:
    for pool in (sched.kv.pool, sched.kv.window_pool):
        assert pool.num_free_blocks == pool.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
        # block_pool.py's queues: each free block in one, and one findable by its hash in a cached tier
        queued = [i for queue in (pool._free_written, pool._free_unwritten, *pool._free_cached) for i in queue]
        assert sorted(queued) == list(range(1, pool.num_blocks))
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash and any(block.block_id in tier for tier in pool._free_cached)
    assert not sched.kv.req_to_blocks and not sched.kv.req_to_window_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_a_long_request_holds_about_a_window_of_window_blocks(caching):
    sched = make_scheduler(window=10, caching=caching)
    sched.add_request(make_request("a", range(100, 160), max_tokens=40))  # 60-token prompt in chunks of 16
    results = run(sched)  # FakeRunner checks every step's reads and holdings
    assert len(results["a"]) == 40
    assert sched.kv.pool.num_blocks_written == 25  # the main pool: all 100 positions
    # The window pool's pages: a window and a chunk's worth, reused; with prefix caching the blocks given back keep
    # their K/V for later hits until no other block is free (as the main pool's), within the pool's size.
    assert sched.kv.window_pool.num_blocks_written <= (sched.kv.window_pool.num_blocks - 1 if caching else 8)
    assert_no_leaks(sched)


def test_outputs_are_the_same_as_without_a_window_pool_under_preemption():
    """Tokens depend on the whole sequence (FakeRunner); tight pools preempt, a roomy one does not."""
    def outputs(**kwargs):
        sched = make_scheduler(budget=16, **kwargs)
        for i in range(4):
            sched.add_request(make_request(f"r{i}", range(10 * i, 10 * i + 30), max_tokens=20))
        results = run(sched)
        assert_no_leaks(sched)
        return results, sched.num_preemptions_total

    roomy, roomy_preemptions = outputs()
    tight, tight_preemptions = outputs(num_blocks=30)  # 29 usable: 4 x 50 tokens need 52
    short_window, window_preemptions = outputs(num_window_blocks=9)  # the window pool is the short one
    assert roomy_preemptions == 0 and tight_preemptions > 0 and window_preemptions > 0
    assert tight == roomy and short_window == roomy


def test_a_prefix_hit_takes_the_window_blocks_of_its_end():
    sched = make_scheduler(window=10)
    prompt = list(range(200, 240))  # 40 tokens: 10 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run(sched)
    sched.add_request(make_request("b", prompt + [1, 2, 3], max_tokens=2))
    out = sched.schedule()
    new = out.new_requests[0]
    assert new.num_computed_tokens == 40  # every full block of the prompt
    # The window of position 40 starts at 31: blocks 7..9 come from the cache, the blocks before are null.
    assert new.window_block_ids[:7] == [0] * 7 and 0 not in new.window_block_ids[7:]
    runner = FakeRunner(sched)
    sched.update_from_output(out, runner.step(out))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.step(out))
    assert_no_leaks(sched)


def test_a_prefix_hit_shortens_to_where_its_window_blocks_are_cached():
    sched = make_scheduler(window=10)
    prompt = list(range(300, 340))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run(sched)
    kv = sched.kv
    evicted = kv.window_pool.cached_blocks.pop(kv.get_computed_blocks(make_request("x", prompt + [1])).blocks[8]
                                               .block_hash)  # block 8's window copy is gone
    assert evicted is not None
    computed = kv.get_computed_blocks(make_request("b", prompt + [1, 2, 3]))
    # Hits ending after block 8 need it; the longest that does not ends at 8 (its window: blocks 5..7).
    assert computed.num_tokens == 32
    assert [b is kv.window_pool.null_block for b in computed.window_blocks] == [True] * 5 + [False] * 3


def planned_scheduler(window, max_num_seqs, num_blocks=400, budget=16):
    """A scheduler whose window pool has what the plan gives it where the budget has room: the running requests'
    blocks and the cached windows (memory/plan.py)."""
    num_window_blocks = (window_pool_blocks(window, BS, max_num_seqs, budget)
                         + window_cache_blocks(window, BS, max_num_seqs) + 1)
    return make_scheduler(window=window, num_blocks=num_blocks, num_window_blocks=num_window_blocks,
                          max_num_seqs=max_num_seqs, budget=budget)


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_a_finished_request_s_last_window_outlasts_what_running_requests_leave_behind(max_num_seqs):
    """Multi-turn chat: a conversation's next turn hits its whole history only while the window pool still holds
    the last window of the turn before. Long requests of other conversations running meanwhile give back a block
    every few tokens; those go back stale and are reused first, and the plan's cached windows keep the finished
    ones (with a pool for the running requests alone and plain LRU it was reused, and the turn recomputed)."""
    sched = planned_scheduler(window=10, max_num_seqs=max_num_seqs)
    first = make_request("turn1", range(500, 520), max_tokens=6)
    sched.add_request(first)
    run(sched)
    history = list(first.all_token_ids)  # 26 tokens
    for i in range(sizes.CACHED_WINDOWS_PER_SEQ * max_num_seqs):  # as many other conversations as it keeps
        sched.add_request(make_request(f"other{i}", range(1000 * (i + 1), 1000 * (i + 1) + 60), max_tokens=40))
    run(sched)
    second = make_request("turn2", history + [7, 8, 9], max_tokens=2)
    assert sched.kv.get_computed_blocks(second).num_tokens == 24  # every full block of the history
    sched.add_request(second)
    run(sched)
    assert_no_leaks(sched)


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_the_window_of_a_prefix_that_hits_keep_ending_at_stays_cached(max_num_seqs):
    """A shared system prompt and messages longer than the window, one request at a time: each request leaves the
    system prompt's window behind while it runs, outside its own prompt's last windows. From the second hit that
    ends there on, those blocks are a shared prefix's (_count_hit_end) and wait with the blocks of finished
    requests instead of being reused first: every request after the first hits the whole system prompt, as with
    one pool (it was lost for good after one miss)."""
    sched = planned_scheduler(window=10, max_num_seqs=max_num_seqs)
    shared = list(range(3000, 3040))  # 40 tokens: a hit ends at 40 and needs blocks 7..9
    requests = [make_request(f"r{i}", shared + list(range(100 * i, 100 * i + 24)), max_tokens=30) for i in range(12)]
    for request in requests:
        sched.add_request(request)
        run(sched)
    assert [r.num_cached_tokens for r in requests] == [0] + [40] * 11
    assert_no_leaks(sched)


def test_the_window_before_a_prompt_s_end_outlasts_what_running_requests_leave_behind():
    """A question about a document, then another request, then a new question about the same document: the hit
    needs the window before the document's end, which the first request left behind while it answered. It waits a
    tier above the other blocks left behind, so the request between reuses those first."""
    sched = planned_scheduler(window=10, max_num_seqs=1)
    document = list(range(4000, 4040))  # 40 tokens: a hit ends at 40 and needs blocks 7..9
    sched.add_request(make_request("q1", document + [1, 2], max_tokens=30))  # the answer outruns the window
    run(sched)
    sched.add_request(make_request("other", range(6000, 6100), max_tokens=60))
    run(sched)
    assert sched.kv.get_computed_blocks(make_request("q2", document + [3, 4, 5])).num_tokens == 40


def test_a_window_pool_needs_its_window():
    with pytest.raises(ValueError, match="both its blocks and its window"):
        KVCacheManager(16, BS, True, num_window_blocks=8)


def test_reset_prefix_cache_forgets_both_pools_only_when_no_request_holds_blocks():
    sched = make_scheduler(window=10)
    sched.add_request(make_request("a", range(40), max_tokens=1))
    run(sched)
    kv = sched.kv
    assert kv.pool.cached_blocks and kv.window_pool.cached_blocks
    sched.add_request(make_request("b", range(100, 120), max_tokens=4))
    sched.schedule()  # b holds blocks
    assert kv.reset_prefix_cache() is False and kv.window_pool.cached_blocks
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert kv.reset_prefix_cache() is True
    assert not kv.pool.cached_blocks and not kv.window_pool.cached_blocks
    assert kv.get_computed_blocks(make_request("c", range(40), max_tokens=1)).num_tokens == 0


def test_usage_is_the_fuller_pool_s():
    sched = make_scheduler(window=10, num_blocks=64, num_window_blocks=9)
    sched.add_request(make_request("a", range(32), max_tokens=4))
    sched.schedule()
    kv = sched.kv
    assert kv.window_pool.usage > kv.pool.usage and kv.usage == kv.window_pool.usage
