"""Block pool, KV-cache manager and scheduler with fake model outputs (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=32, max_model_len=256, caching=True,
                   chunked=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked)
    return Scheduler(config, kv)


def make_request(rid, prompt, max_tokens=4, eos=None, **params) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return Request(rid, list(prompt), sp, eos_token_id=eos, max_tokens=max_tokens)


def fake_runner(out: SchedulerOutput, token=7) -> ModelRunnerOutput:
    """A model that always predicts `token` (or per-request token via a dict)."""
    sampled = {rid: [token[rid] if isinstance(token, dict) else token]
               for rid, need in out.needs_sample.items() if need}
    return ModelRunnerOutput(sampled_token_ids=sampled)


def run_to_completion(sched: Scheduler, max_steps=1000, token=7) -> dict[str, list[int]]:
    results: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        check_budget(sched, out)
        for o in sched.update_from_output(out, fake_runner(out, token)):
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not sched.has_unfinished_requests()
    return results


def check_budget(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs


def assert_no_leaks(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not sched.kv.req_to_blocks


def test_core_does_not_import_torch():
    code = ("import sys, pagedserve.core.scheduler, pagedserve.core.kv_cache_manager, pagedserve.request, "
            "pagedserve.sampling_params; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_pool_refcount_and_lru_eviction():
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_free_blocks == 4
    a, b = pool.get_new_blocks(2)
    from pagedserve.core.block_pool import hash_block_tokens
    ha = hash_block_tokens(None, (1, 2))
    pool.cache_full_block(a, ha)
    pool.free_blocks([a, b])
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(ha) is a  # still cached while free
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free_blocks([a])
    # Free queue order is now c, d (never used), b, a (freed last): taking 3 keeps a cached.
    pool.get_new_blocks(3)
    assert pool.get_cached_block(ha) is a
    pool.get_new_blocks(1)
    assert pool.get_cached_block(ha) is None
    assert pool.num_evictions == 1
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)


def test_block_pool_counts_the_distinct_blocks_it_handed_out():
    # What is resident of a lazily allocated KV pool: every block ever handed out, reused or not.
    pool = BlockPool(5, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    assert pool.num_blocks_written == 2
    pool.free_blocks([a, b])
    assert set(pool.get_new_blocks(2)) == {a, b}  # freed, written blocks come first: nothing new is resident
    assert pool.num_blocks_written == 2
    assert pool.get_new_blocks(2)[0] not in (a, b)  # then the never-written ones
    assert pool.num_blocks_written == 4


@pytest.mark.parametrize("caching", [False, True])
def test_resident_blocks_stay_at_the_most_in_use_at_once(caching):
    """One request at a time, each with its own prompt: without prefix caching the pool reuses the blocks it
    wrote, so what is resident stays at one request's blocks (it went round the whole pool: RSS grew toward all
    of it); with it, the cache fills the pool before evicting, as the README says."""
    sched = make_scheduler(num_blocks=40, caching=caching)
    for i in range(30):
        sched.add_request(make_request(f"r{i}", range(100 * i, 100 * i + 20), max_tokens=3))
        run_to_completion(sched)
    written = sched.kv.pool.num_blocks_written
    assert written == (39 if caching else 6)  # 20 prompt + 3 tokens: 6 blocks of 4 (the whole pool: 39)
    assert_no_leaks(sched)


def test_cached_blocks_outlive_blocks_that_hold_nothing():
    from pagedserve.core.block_pool import hash_block_tokens

    pool = BlockPool(5, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    ha = hash_block_tokens(None, (1, 2))
    pool.cache_full_block(a, ha)
    pool.free_blocks([a, b, c])  # a cached, b and c partial (no hash)
    assert set(pool.get_new_blocks(3)) == {b, c, pool.blocks[4]}  # then the never written, before evicting a
    assert pool.get_cached_block(ha) is a and pool.num_evictions == 0
    assert pool.get_new_blocks(1) == [a] and pool.get_cached_block(ha) is None


def test_cached_blocks_of_a_lower_tier_make_room_before_the_others():
    """The window pool frees the blocks a running request leaves behind into tier 0 (core/kv_cache_manager.py):
    they stay findable, and are taken after the blocks that hold nothing and the never-written ones but before
    the cached blocks of the last tier; a hit on one takes it out of its queue; releases and resets forget them."""
    from pagedserve.core.block_pool import NUM_TIERS, hash_block_tokens

    pool = BlockPool(7, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    ha, hb, hc = (hash_block_tokens(None, (i,)) for i in range(3))
    for block, block_hash in ((a, ha), (b, hb), (c, hc)):
        pool.cache_full_block(block, block_hash)
    pool.free_blocks([a])  # the last tier (a request's last window): evicted last
    pool.free_blocks([b, c, d], 0)  # d holds nothing (no hash): taken first, whatever its tier
    assert pool.get_cached_block(hb) is b and pool.num_free_blocks == 6
    pool.touch([c])  # a hit on a block of tier 0
    assert c.ref_cnt == 1 and pool.num_free_blocks == 5
    assert pool.get_new_blocks(2) == [d, pool.blocks[5]] and pool.get_cached_block(hb) is b
    assert pool.get_new_blocks(2) == [pool.blocks[6], b] and pool.get_cached_block(hb) is None
    assert pool.get_cached_block(ha) is a
    pool.free_blocks([c], 0)
    assert pool.get_new_blocks(1) == [c] and pool.get_new_blocks(1) == [a] and pool.num_free_blocks == 0
    pool.free_blocks([a, b])
    pool.cache_full_block(c, hc)
    pool.free_blocks([c], NUM_TIERS - 2)
    assert sorted(pool.release_free_blocks()) == [a.block_id, b.block_id, c.block_id]
    assert pool.get_cached_block(hc) is None and pool.num_free_blocks == 3


def test_the_last_tier_keeps_at_most_its_cap_and_moves_its_oldest_down():
    from pagedserve.core.block_pool import hash_block_tokens

    pool = BlockPool(6, enable_caching=True, last_tier_cap=2)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, hash_block_tokens(None, (i,)))
    pool.free_blocks([blocks[3]], 0)
    pool.free_blocks(blocks[:3])  # the oldest of the three goes down a tier, after the block already there
    pool.get_new_blocks(1)  # the never-written block
    assert pool.get_new_blocks(2) == [blocks[3], blocks[0]] and pool.get_new_blocks(2) == blocks[1:3]


def test_reset_prefix_cache_forgets_every_tier():
    from pagedserve.core.block_pool import hash_block_tokens

    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, hash_block_tokens(None, (1,)))
    pool.cache_full_block(b, hash_block_tokens(None, (2,)))
    pool.free_blocks([a], 0)
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() and not pool.cached_blocks
    assert pool.num_free_blocks == 2 and sorted(b.block_id for b in pool.get_new_blocks(2)) == [1, 2]


def test_block_pool_releases_free_blocks_once_and_forgets_their_hashes():
    from pagedserve.core.block_pool import hash_block_tokens

    pool = BlockPool(6, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    ha = hash_block_tokens(None, (1, 2))
    pool.cache_full_block(a, ha)
    pool.free_blocks([a, b])  # c stays in use
    assert sorted(pool.release_free_blocks()) == [a.block_id, b.block_id]  # never-used blocks have no pages
    assert pool.get_cached_block(ha) is None and c.ref_cnt == 1
    assert pool.num_blocks_written == 1 and pool.num_free_blocks == 4
    assert pool.release_free_blocks() == []  # already released


def test_held_waiting_queue_lets_running_requests_finish():
    # Under memory pressure the scheduler starts nothing new; what runs goes on; the held request runs later.
    sched = make_scheduler()
    sched.add_request(make_request("running", range(8), max_tokens=3))
    sched.update_from_output(out := sched.schedule(), fake_runner(out))
    sched.hold_waiting = True
    sched.add_request(make_request("held", range(100, 108), max_tokens=3))
    for _ in range(5):
        out = sched.schedule()
        assert "held" not in out.num_scheduled_tokens
        sched.update_from_output(out, fake_runner(out))
    assert [r.request_id for r in sched.waiting] == ["held"] and not sched.running
    sched.hold_waiting = False
    assert run_to_completion(sched)["held"] == [7, 7, 7]
    assert_no_leaks(sched)


def test_budget_and_max_num_seqs_respected():
    sched = make_scheduler(max_num_seqs=3, budget=10)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", range(100 * i, 100 * i + 9), max_tokens=5))
    max_running = 0
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        check_budget(sched, out)
        max_running = max(max_running, len(sched.running))
        sched.update_from_output(out, fake_runner(out))
    assert max_running == 3
    assert_no_leaks(sched)


def test_prompt_prefilled_in_chunks():
    sched = make_scheduler(budget=7)
    sched.add_request(make_request("a", range(20), max_tokens=2))
    chunks = []
    for _ in range(10):
        out = sched.schedule()
        if out.is_empty:
            break
        chunks.append((out.num_scheduled_tokens["a"], out.needs_sample["a"]))
        sched.update_from_output(out, fake_runner(out))
    # 20 prompt tokens in chunks of 7, 7, 6 (sample only after the last), then one decode.
    assert chunks == [(7, False), (7, False), (6, True), (1, True)]
    assert_no_leaks(sched)


def test_chunked_prefill_disabled_waits_for_budget():
    sched = make_scheduler(budget=8, chunked=False)
    sched.add_request(make_request("big", range(9)))
    out = sched.schedule()
    assert out.is_empty  # never split; a prompt over the budget cannot be scheduled at all


def test_finish_on_max_tokens_eos_and_stop_token():
    sched = make_scheduler()
    sched.add_request(make_request("len", range(5), max_tokens=3))
    sched.add_request(make_request("eos", range(10, 15), max_tokens=10, eos=7))
    sched.add_request(make_request("ign", range(20, 25), max_tokens=4, eos=7, ignore_eos=True))
    sched.add_request(make_request("stop", range(30, 35), max_tokens=10, stop_token_ids=[7]))
    sched.add_request(make_request("min", range(40, 45), max_tokens=10, eos=7, min_tokens=2))
    reasons, results = {}, {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for o in sched.update_from_output(out, fake_runner(out)):
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = (o.finish_reason, o.stop_reason)
    assert results == {"len": [7] * 3, "eos": [7], "ign": [7] * 4, "stop": [7], "min": [7, 7]}
    assert reasons == {"len": ("length", None), "eos": ("stop", None), "ign": ("length", None),
                       "stop": ("stop", 7), "min": ("stop", None)}
    assert_no_leaks(sched)


def test_prefix_cache_hits_counted_and_blocks_shared():
    sched = make_scheduler(budget=64)
    prefix = list(range(100, 117))  # 17 tokens = 4 full blocks + 1
    sched.add_request(make_request("a", prefix + [1, 2], max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", prefix + [3, 4, 5], max_tokens=1))
    out = sched.schedule()
    # 4 full blocks (16 tokens) come from the cache: only 4 tokens are computed.
    assert out.num_scheduled_tokens["b"] == 4
    assert out.new_requests[0].num_computed_tokens == 16
    assert sched.kv.stats.num_hits == 16
    sched.update_from_output(out, fake_runner(out))
    assert_no_leaks(sched)


def test_prefix_cache_stats_count_each_request_once():
    """As vLLM's: a lookup counts when the request is admitted, once; not for each step it waits on a full pool,
    and not again after a preemption (its own blocks would read as hits)."""
    sched = make_scheduler(num_blocks=13, budget=64)  # 12 usable blocks of 4: room for two 20-token sequences
    for i in range(4):  # no shared prefixes: every query misses
        sched.add_request(make_request(f"r{i}", range(100 * i, 100 * i + 12), max_tokens=12))
    run_to_completion(sched)
    assert sched.num_preemptions_total > 0  # (and requests waited for blocks while others ran)
    assert sched.kv.stats.num_queries == 4 * 12 and sched.kv.stats.num_hits == 0


def test_full_prompt_hit_still_computes_last_token():
    sched = make_scheduler()
    prompt = list(range(8))  # exactly two blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out = sched.schedule()
    assert out.num_scheduled_tokens["b"] == 4  # second block recomputed to get the last logits
    sched.update_from_output(out, fake_runner(out))
    assert_no_leaks(sched)


def test_prefix_cache_lru_eviction():
    sched = make_scheduler(num_blocks=9)  # 8 usable blocks
    sched.add_request(make_request("a", range(0, 16), max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", range(50, 66), max_tokens=1))
    run_to_completion(sched)
    # 'a' and 'b' blocks are all cached and free; a 24-token request must evict the oldest.
    sched.add_request(make_request("c", range(200, 224), max_tokens=1))
    run_to_completion(sched)
    assert sched.kv.pool.num_evictions > 0
    # Eviction order: all of 'a' (freed first), then the tail blocks of 'b'; b's head survives.
    sched.add_request(make_request("b2", range(50, 66), max_tokens=1))
    sched.add_request(make_request("a2", range(0, 16), max_tokens=1))
    out = sched.schedule()
    assert [r.num_computed_tokens for r in out.new_requests] == [8, 0]
    sched.update_from_output(out, fake_runner(out))
    run_to_completion(sched)
    assert_no_leaks(sched)


def test_preemption_and_resumption_give_same_tokens():
    # A fake model whose next token depends on the whole sequence: sum of tokens mod 97.
    def model(out, sched):
        sampled = {}
        for rid, need in out.needs_sample.items():
            if need:
                sampled[rid] = [sum(sched.requests[rid].all_token_ids) % 97]
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def run(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, budget=64, caching=False)
        for i in range(4):
            sched.add_request(make_request(f"r{i}", range(i, i + 10), max_tokens=12))
        results = {}
        while sched.has_unfinished_requests():
            out = sched.schedule()
            for o in sched.update_from_output(out, model(out, sched)):
                results.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert_no_leaks(sched)
        return results, sched.num_preemptions_total

    roomy, roomy_preemptions = run(64)
    tight, tight_preemptions = run(10)  # 9 usable blocks; 4 requests need 6 blocks each at the end
    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    assert tight == roomy


def test_abort_frees_blocks_running_and_waiting():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", range(10), max_tokens=50))
    sched.add_request(make_request("b", range(10), max_tokens=50))
    out = sched.schedule()
    sched.update_from_output(out, fake_runner(out))
    assert sched.kv.pool.num_free_blocks < sched.kv.pool.num_blocks - 1
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert_no_leaks(sched)
    assert sched.schedule().finished_request_ids == ["a", "b"]


def test_request_added_mid_generation_joins_batch():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("a", range(10), max_tokens=6))
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, fake_runner(out))
    sched.add_request(make_request("b", range(30, 40), max_tokens=3))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}
    sched.update_from_output(out, fake_runner(out))
    results = run_to_completion(sched)
    assert len(results["b"]) == 2  # plus the first, sampled above
    assert_no_leaks(sched)


def test_max_model_len_stops_generation():
    sched = make_scheduler(max_model_len=12)
    sched.add_request(make_request("a", range(10), max_tokens=100))
    results = run_to_completion(sched)
    assert len(results["a"]) == 2
    assert_no_leaks(sched)


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(3)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", range(3)))


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)  # -1: the vocabulary (vLLM's); the upper bound is the engine's --max-logprobs
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="n "):
        SamplingParams(n=0)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]


def test_priority_policy_schedules_lower_values_first_and_preempts_the_lowest_priority():
    kv = KVCacheManager(6, BS, enable_caching=False)
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256, max_model_len=256, policy="priority")
    sched = Scheduler(config, kv)
    for rid, priority in (("late-low", 5), ("mid", 1), ("urgent", 0)):
        sched.add_request(make_request(rid, range(10), priority=priority))
    assert [r.request_id for r in sched.waiting] == ["urgent", "mid", "late-low"]
    out = sched.schedule()
    assert [n.request_id for n in out.new_requests] == ["urgent"]  # one seat: the lowest value takes it
    # Preemption takes the lowest priority running request, not the newest: 6 blocks of 4 tokens hold both
    # 8-token prompts, not both grown to 24 tokens.
    kv = KVCacheManager(6, BS, enable_caching=False)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256, policy="priority")
    sched = Scheduler(config, kv)
    sched.add_request(make_request("low", range(8), max_tokens=16, priority=9))
    out = sched.schedule()  # "low" runs first, alone; "high" arrives after it (the newest: fcfs's victim)
    sched.update_from_output(out, fake_runner(out))
    sched.add_request(make_request("high", range(8), max_tokens=16, priority=0))
    preempted = []
    for _ in range(30):
        out = sched.schedule()
        preempted += out.preempted_request_ids
        if preempted:
            break
        sched.update_from_output(out, fake_runner(out))
    assert preempted == ["low"]


def test_fcfs_keeps_arrival_order_whatever_the_priority():
    sched = make_scheduler(max_num_seqs=1)
    for rid, priority in (("first", 5), ("second", 0)):
        sched.add_request(make_request(rid, range(10), priority=priority))
    assert [n.request_id for n in sched.schedule().new_requests] == ["first"]


def test_long_prefill_token_threshold_lets_short_requests_start_beside_a_long_prompt():
    """vLLM's --long-prefill-token-threshold: a long prompt's chunk is capped, so a short request that arrives
    behind it is scheduled in the next step (it waited for the whole long prefill: 147 s behind a 32k prompt)."""
    def first_step_of_short(threshold: int) -> int:
        kv = KVCacheManager(256, BS, enable_caching=False)
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=512,
                                 long_prefill_token_threshold=threshold)
        sched = Scheduler(config, kv)
        sched.add_request(make_request("long", range(1, 301)))
        for step in range(1, 30):
            if step == 2:
                sched.add_request(make_request("short", [5, 6, 7]))
            out = sched.schedule()
            check_budget(sched, out)
            if threshold:
                assert out.num_scheduled_tokens.get("long", 0) <= threshold
            if "short" in out.num_scheduled_tokens:
                return step
            sched.update_from_output(out, fake_runner(out))
        raise AssertionError("the short request never ran")

    assert first_step_of_short(0) > 5  # the long prompt takes each whole 32-token step until it is done
    assert first_step_of_short(16) == 2


def test_block_keys_are_128_bit_digests_the_same_in_every_process():
    """Prefix-cache keys chain a 128-bit BLAKE2b digest (Python's 61-bit hash() was not made to resist crafted
    collisions; vLLM moved to SHA-256 for that, advisory GHSA-rm76-4mrf-v9r8): the same chain gives the same key in
    another process, and a different parent gives another key for the same tokens."""
    import subprocess
    import sys

    from pagedserve.core.block_pool import hash_block_tokens

    first = hash_block_tokens(None, (1, 2, 3))
    second = hash_block_tokens(first, (4, 5, 6))
    assert second.hash_value.bit_length() > 64 and hash_block_tokens(None, (4, 5, 6)) != second
    code = ("from pagedserve.core.block_pool import hash_block_tokens as h; "
            "print(h(h(None, (1, 2, 3)), (4, 5, 6)).hash_value)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert int(other.stdout) == second.hash_value
