"""Gemma 2/3's sliding-window layers with a KV pool of their own (core/kv_cache_manager.py): against transformers
while the two pools' blocks diverge (window blocks given back and reused, a window pool far smaller than the main
one), on the native decode stack and the per-layer paths, with prefix-cache hits; the plan's smaller KV pool; and
--disable-hybrid-kv-cache-manager."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.setup import create_engine_config
from pagedserve.memory.probe import AvailableMemory
from pagedserve.models.llama import NativeDecodeStack
from tests.models.test_sliding_window import WINDOW, _check, _long_prompts

GIB = 1 << 30


def _window_pool_reused(llm: LLM) -> bool:
    """Whether the window pool handed blocks out again (so its slots and the main pool's differ)."""
    kv = llm.engine.kv
    return kv.window_pool is not None and kv.window_pool.num_blocks_written < kv.pool.num_blocks_written


def test_the_decode_stack_writes_and_reads_the_window_pool(kernels, tiny_model_dir, monkeypatch):
    """bf16 at head_dim 32: decodes run on the native decode stack, whose window layers write their new K/V at their
    own pool's slots. Without prefix caching, blocks given back are the first reused, so the pools' slots part."""
    calls = []
    original = NativeDecodeStack.forward
    monkeypatch.setattr(NativeDecodeStack, "forward", lambda self, *a: calls.append(1) or original(self, *a))
    model_dir = tiny_model_dir("gemma3", "bfloat16", head_dim=32, hidden_size=128, intermediate_size=256,
                               weight_std=0.1)
    llm = _check(model_dir, "bfloat16", enable_prefix_caching=False)
    assert calls and _window_pool_reused(llm)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_small_window_pool_against_transformers(tiny_model_dir, arch):
    """Two sequences at a time and 16-token steps: the window pool holds 8 blocks against the main pool's 33 (the
    running sequences' 7 and the null block: a block count asked for leaves out cached windows), with prefix caching
    (blocks given back stay findable until reused) and chunked prefill past the window."""
    llm = _check(tiny_model_dir(arch), "float32", max_num_seqs=2, max_num_batched_tokens=WINDOW,
                 enable_chunked_prefill=True, block_size=16, num_gpu_blocks_override=33)
    kv = llm.engine.kv
    assert (kv.pool.num_blocks, kv.window_pool.num_blocks) == (33, 8)
    assert _window_pool_reused(llm)
    windowed = [w is not None for w in llm.engine.runner.model.layer_windows]
    assert [cache.k.shape[0] for cache in llm.engine.runner.kv_caches] == [8 * 16 if w else 33 * 16 for w in windowed]


def test_a_prefix_hit_with_a_small_window_pool(tiny_model_dir):
    """A hit of 64 tokens whose window blocks the pool kept: the same tokens and logprobs as without caching."""
    model_dir = tiny_model_dir("gemma3")
    kwargs = dict(dtype="float32", max_model_len=256, block_size=16, max_num_seqs=2, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    shared = _long_prompts()[-1][:64]
    llm = LLM(model_dir, enable_prefix_caching=True, **kwargs)
    llm.generate([{"prompt_token_ids": shared + [7]}], params)
    hit = llm.generate([{"prompt_token_ids": shared + [9, 10, 11]}], params)[0]
    assert hit.num_cached_tokens == 64
    fresh = LLM(model_dir, enable_prefix_caching=False, **kwargs).generate(
        [{"prompt_token_ids": shared + [9, 10, 11]}], params)[0]
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids
    for ours, theirs in zip(hit.outputs[0].logprobs, fresh.outputs[0].logprobs):
        assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-5 for t in theirs)


def test_disabled_the_window_layers_share_the_one_pool(tiny_model_dir):
    model_dir = tiny_model_dir("gemma2")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _long_prompts()]
    outputs = {}
    for disabled in (False, True):
        llm = LLM(model_dir, dtype="float32", max_model_len=256, enable_prefix_caching=False,
                  disable_hybrid_kv_cache_manager=disabled)
        assert (llm.engine.kv.window_pool is None) == disabled
        assert len({cache.k.shape[0] for cache in llm.engine.runner.kv_caches}) == 1 + (not disabled)
        outputs[disabled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs[False] == outputs[True]


def test_the_plan_counts_a_window_of_each_sequence_for_the_window_layers(tiny_model_dir):
    """Gemma 3's layers alternate windowed and full here: at a long context the KV pool is about half the bytes of one
    pool for every layer, and with the same memory the main pool holds nearly twice the tokens."""
    model_dir = tiny_model_dir("gemma3", max_position_embeddings=32768)
    available = AvailableMemory(64 * GIB, "MemAvailable", "a test")

    def plan(**kwargs):
        args = EngineArgs(model=model_dir, max_model_len=32768, max_num_seqs=4, **kwargs)
        config = create_engine_config(args, available=available)
        return config.memory_plan, config.cache

    hybrid, cache = plan()
    single, single_cache = plan(disable_hybrid_kv_cache_manager=True)
    assert single.num_window_blocks == 0 and single_cache.num_window_blocks == 0
    assert hybrid.num_kv_blocks == single.num_kv_blocks == 4 * 32768 // 16  # the workload: 4 full sequences
    # 4 sequences x (a window of 16 over 1 block + 2) + a step's 2048 tokens: 12 + 128 blocks; the budget has room
    # beside the workload, so 4 cached windows per sequence too (16 tokens over 2 blocks each): 32 blocks
    assert hybrid.num_window_blocks == 172 and cache.num_window_blocks == 173 and cache.sliding_window == WINDOW
    assert hybrid.kv_pool_bytes == hybrid.num_kv_blocks * hybrid.block_bytes + 172 * hybrid.window_block_bytes
    assert hybrid.block_bytes == hybrid.window_block_bytes == single.block_bytes // 2
    assert hybrid.kv_pool_bytes < 0.52 * single.kv_pool_bytes
    assert hybrid.kv_cache_report()["num_window_blocks"] == 172
    # An explicit pool: the same bytes hold about twice the main pool's blocks; bytes beyond the workload's pools
    # take the cached windows first.
    budget = 256 << 20
    hybrid, _ = plan(kv_cache_memory=budget)
    single, _ = plan(kv_cache_memory=budget, disable_hybrid_kv_cache_manager=True)
    assert hybrid.kv_pool_bytes <= budget and single.kv_pool_bytes <= budget
    assert hybrid.num_window_blocks == 172
    assert hybrid.num_kv_blocks == (budget - 172 * hybrid.window_block_bytes) // hybrid.block_bytes
    assert hybrid.num_kv_blocks > 1.9 * single.num_kv_blocks
    # Bytes for less than the workload: no cached windows, the main pool takes what the running windows leave.
    short = 8000 * hybrid.block_bytes
    hybrid, _ = plan(kv_cache_memory=short)
    assert hybrid.num_window_blocks == 140
    assert hybrid.num_kv_blocks == (short - 140 * hybrid.window_block_bytes) // hybrid.block_bytes < 4 * 32768 // 16
    # A block count asked for: exactly its blocks, the window pool the running requests' only.
    exact, exact_cache = plan(num_gpu_blocks_override=20001)
    assert exact.num_window_blocks == 140 and exact_cache.num_window_blocks == 141
    assert exact.kv_pool_bytes == 20000 * exact.block_bytes + 140 * exact.window_block_bytes


def test_cached_windows_come_from_what_the_budget_leaves_beside_the_workload(tiny_model_dir):
    """The window pool's cached windows (sizes.window_cache_blocks) take the bytes the budget and the shared-box
    cap leave beside the workload's pools, never the main pool's: where a byte bound decides the main pool they get
    none, where the workload does all of them or what is left; the plan stays within its budget."""
    model_dir = tiny_model_dir("gemma3", max_position_embeddings=32768)
    running, cached, workload = 140, 32, 4 * 32768 // 16
    seen = set()
    # From the budget deciding to the workload with room to spare, and 8-KiB steps where the room for cached
    # windows begins (this tiny model's; `seen` fails if a change to the plan's constants moves it).
    for kib in [*range(481 << 10, 505 << 10, 1 << 10), *range(507_200, 507_500, 8)]:
        args = EngineArgs(model=model_dir, max_model_len=32768, max_num_seqs=4)
        available = AvailableMemory(kib << 10, "MemAvailable", "a test")
        plan = create_engine_config(args, available=available, check_memory=False).memory_plan
        assert plan.fits and plan.total_bytes <= plan.budget_bytes, kib
        host = plan.request.host_bytes_per_block
        if plan.kv_sizing != "workload":
            assert plan.num_window_blocks == running and plan.num_kv_blocks < workload, kib
            seen.add("none")
            continue
        left = plan.budget_bytes - (plan.total_bytes - plan.kv_pool_bytes - plan.kv_bookkeeping_bytes)
        limit = min(left, int(plan.request.kv_share * available.num_bytes))
        spare = (limit - workload * (plan.block_bytes + host)) // (plan.window_block_bytes + host) - running
        assert plan.num_kv_blocks == workload and plan.num_window_blocks == running + min(cached, spare), kib
        seen.add("all" if spare >= cached else "some")
    assert seen == {"none", "some", "all"}


def test_the_suggested_block_override_fits_with_its_window_pool(tiny_model_dir):
    """A --num-gpu-blocks-override that does not fit gets the override that does: its window pool counted too,
    or one pool where the window pool would hold as many blocks as the main pool (the engine plans one there)."""
    model_dir = tiny_model_dir("gemma3")
    mib = 1 << 20

    def plan(blocks: int, available: int):
        args = EngineArgs(model=model_dir, max_model_len=512, max_num_seqs=64, num_gpu_blocks_override=blocks,
                          dtype="float32")
        config = create_engine_config(args, available=AvailableMemory(available, "MemAvailable", "a test"),
                                      check_memory=False)
        return config.memory_plan

    pools = []
    for available in range(460 * mib, 480 * mib, 3 * mib // 2):
        suggestion = next((s for s in plan(400_000, available).suggestions
                           if s.flag == "--num-gpu-blocks-override"), None)
        if suggestion is None:
            continue
        again = plan(int(suggestion.value), available)
        assert again.fits and again.total_bytes == suggestion.needs_bytes, available
        pools.append("two" if again.num_window_blocks else "one")
    assert pools.count("two") >= 5 and "one" in pools


def test_the_first_memory_reading_counts_the_window_pool(tiny_model_dir):
    """Warm-up writes blocks in both pools; the reading taken as the engine starts counts both."""
    llm = LLM(tiny_model_dir("gemma3"), dtype="float32", max_model_len=256)
    engine = llm.llm_engine
    reading = engine.resident_memory.last
    assert reading.window_blocks_written == engine.kv.num_window_blocks_written > 0
    assert reading.kv_blocks_written == engine.kv.num_blocks_written


def test_a_window_on_every_layer_leaves_the_main_pool_without_k_v(tiny_model_dir, tmp_path):
    """Mistral's kind (every layer windowed): all K/V live in the window pool, sized for two sequences' windows and
    a step (and, planned, four cached windows per sequence); the main pool is block-table bookkeeping only, and the
    plan counts no bytes for it."""
    from tests.models.test_sliding_window import _mistral

    model_dir = _mistral(tiny_model_dir, tmp_path, "float32")
    kwargs = dict(max_num_seqs=2, max_num_batched_tokens=WINDOW, enable_chunked_prefill=True, block_size=16)
    llm = _check(model_dir, "float32", num_gpu_blocks_override=33, **kwargs)
    engine = llm.llm_engine
    assert engine.kv.window_pool.num_blocks == 8 and _window_pool_reused(llm)
    assert {cache.k.shape[0] for cache in engine.runner.kv_caches} == {8 * 16}
    plan = engine.config.memory_plan
    assert plan.block_bytes == 0 and plan.kv_pool_bytes == 7 * plan.window_block_bytes > 0
    args = EngineArgs(model=model_dir, dtype="float32", max_model_len=256, **kwargs)
    planned = create_engine_config(args, available=AvailableMemory(64 * GIB, "MemAvailable", "a test")).memory_plan
    assert planned.num_window_blocks == 7 + 16 and planned.kv_pool_bytes == 23 * planned.window_block_bytes


def test_a_window_as_long_as_the_context_keeps_one_pool(tiny_model_dir):
    llm = LLM(tiny_model_dir("gemma3"), dtype="float32", max_model_len=WINDOW)
    assert llm.llm_engine.kv.window_pool is None


def test_a_window_pool_as_large_as_the_main_pool_gives_way_to_one_pool(tiny_model_dir, monkeypatch, caplog):
    """A context little longer than the window: the window layers' running windows and a step's tokens need as many
    blocks as the main pool, so a pool of their own would save no K/V and cost a second block's bookkeeping: the
    engine plans one pool, with at least the two pools' main blocks, in less memory. A longer context keeps two."""
    from pagedserve.memory import plan as memory

    model_dir = tiny_model_dir("gemma3", max_position_embeddings=4096)
    available = AvailableMemory(64 * GIB, "MemAvailable", "a test")

    def config(max_model_len: int):
        args = EngineArgs(model=model_dir, dtype="float32", max_model_len=max_model_len, max_num_seqs=4,
                          max_num_batched_tokens=256, block_size=16)
        return create_engine_config(args, available=available)

    with caplog.at_level("INFO", logger="pagedserve.engine.memory_plan"):
        near = config(2 * WINDOW)
    assert near.cache.num_window_blocks == 0 and near.memory_plan.num_window_blocks == 0
    assert "would hold as many blocks as it" in caplog.text
    with monkeypatch.context() as patch:
        patch.setattr(memory, "window_pool_saves_nothing", lambda plan: False)
        two = config(2 * WINDOW).memory_plan
    assert two.num_window_blocks == two.num_kv_blocks  # the window pool as large as the main pool
    assert near.memory_plan.num_kv_blocks >= two.num_kv_blocks
    assert near.memory_plan.total_bytes < two.total_bytes
    far = config(2048)
    assert 0 < far.memory_plan.num_window_blocks < far.memory_plan.num_kv_blocks and far.cache.num_window_blocks
    llm = LLM(model_dir, dtype="float32", max_model_len=2 * WINDOW, max_num_seqs=4, max_num_batched_tokens=256)
    assert llm.llm_engine.kv.window_pool is None
