"""Free KV blocks' pages go back to the OS under memory pressure (memory/pressure.py) on the real pool tensors."""

from __future__ import annotations

import time

import pytest
import torch

from pagedserve.layers.attention import LayerKVCache
from pagedserve.memory.pressure import release_block_pages
from pagedserve.memory.probe import process_rss_bytes
from pagedserve.platform import lazy_zeros

MIB = 1 << 20


def test_released_blocks_leave_rss_and_read_back_as_zeros() -> None:
    # 2 layers x K and V of 4096 blocks x 16 tokens x 4 heads x 64 x 2 B (8 KiB a block): 32 MiB each.
    block_size, num_blocks, shape = 16, 4096, (4096 * 16, 4, 64)
    caches = [LayerKVCache(lazy_zeros(shape, torch.bfloat16, "cpu"), lazy_zeros(shape, torch.bfloat16, "cpu"))
              for _ in range(2)]
    before = process_rss_bytes()
    for cache in caches:
        cache.k.fill_(1.0)
        cache.v.fill_(2.0)
    written = process_rss_bytes()
    assert written - before >= 120 * MIB
    released = release_block_pages(caches, list(range(1, num_blocks // 2)), block_size)  # block 0 and the upper half stay
    assert released == 4 * (num_blocks // 2 - 1) * 8192
    after = process_rss_bytes()
    assert written - after >= 0.9 * released, (written / MIB, after / MIB)
    for cache in caches:
        assert bool((cache.k[block_size:num_blocks // 2 * block_size] == 0).all())  # zeros: finite for masked reads
        assert bool((cache.k[:block_size] == 1).all()) and bool((cache.v[num_blocks // 2 * block_size:] == 2).all())


@pytest.mark.parametrize("runner", ["ModelRunner", "DecoderPoolingRunner", "EncoderRunner", "TPModelRunner"])
def test_every_runner_takes_what_give_way_passes(runner):
    """give_way calls release(block_ids, block_size, window_block_ids) on the engine's runner, whichever it is (an
    encoder embedding model's EncoderRunner too: it has blocks, and no pages)."""
    import inspect

    from pagedserve.worker import model_runner, pooling_runner, tp_worker

    cls = {"ModelRunner": model_runner.ModelRunner, "DecoderPoolingRunner": pooling_runner.DecoderPoolingRunner,
           "EncoderRunner": pooling_runner.EncoderRunner, "TPModelRunner": tp_worker.TPModelRunner}[runner]
    inspect.signature(cls.release_kv_pages).bind(None, [3, 4], 16, [5])


def test_an_idle_engine_gives_way_and_a_held_queue_does_not_spin(tiny_model_dir):
    """The engine loop (AsyncEngine) under pressure: idle, it still gives the free KV blocks' pages back (the
    prefix cache a finished request left was pinned for as long as no request came, QA-O); with only held
    requests it waits between readings of the headroom instead of stepping an empty schedule (a core spun);
    when the pressure ends the held request runs."""
    import asyncio

    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.memory.pressure import MemoryPressure, PressureThresholds
    from pagedserve.memory.probe import AvailableMemory
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(tiny_model_dir("llama"), max_model_len=256, num_threads=1)
    llm.generate("warm " * 40, SamplingParams(max_tokens=1))
    written = llm.engine.kv.num_blocks_written
    assert written > 0
    available = [AvailableMemory(1 << 33, "MemAvailable", "simulated", total_bytes=1 << 34)]
    llm.engine.give_way_under(MemoryPressure(lambda: available[0], PressureThresholds.for_memory(1 << 34)))
    steps = [0]
    step = llm.engine.step

    def counted():
        steps[0] += 1
        return step()

    llm.engine.step = counted
    engine = AsyncEngine(llm.engine)
    try:
        available[0] = AvailableMemory(100 * MIB, "MemAvailable", "simulated", total_bytes=1 << 34)
        deadline = time.monotonic() + 30
        while llm.engine.kv.num_blocks_written and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.engine.kv.num_blocks_written == 0 and steps[0] == 0  # given back with no step run

        async def held_then_served():
            stream = engine.generate("held", "x", SamplingParams(max_tokens=2, ignore_eos=True))
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(1.5)
            assert not first.done() and steps[0] <= 10, steps[0]  # ~2 empty steps a second, not thousands
            available[0] = AvailableMemory(1 << 33, "MemAvailable", "simulated", total_bytes=1 << 34)
            await asyncio.wait_for(first, 30)
            async for _ in stream:
                pass

        asyncio.run(held_then_served())
    finally:
        engine.shutdown()


def test_a_long_idle_server_gives_its_kv_pages_back(tiny_model_dir):
    """After --kv-cache-idle-release-s with nothing to run, the free blocks' pages go back (once per idle spell,
    the prefix cache with them) and RSS is read again; a request then computes its prompt afresh and answers as
    before. The whole pool stayed resident after a light, varied load (QA-Y)."""
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(tiny_model_dir("llama"), max_model_len=256, num_threads=1, kv_cache_idle_release_s=60)
    engine = llm.engine
    now = [1000.0]
    engine.clock = lambda: now[0]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = "shared prefix " * 20
    first = llm.generate(prompt, greedy)[0]
    written = engine.kv.num_blocks_written
    assert written > 0 and engine.idle_since == 1000.0
    now[0] += 59
    engine.idle()
    assert engine.kv.num_blocks_written == written  # not idle long enough
    now[0] += 2
    engine.idle()
    assert engine.kv.num_blocks_written == 0 and engine.idle_since is None
    assert engine.resident_memory.last.kv_blocks_written == 0  # RSS read again against the smaller expectation
    again = llm.generate(prompt, greedy)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    off = LLM(tiny_model_dir("llama"), max_model_len=256, num_threads=1, kv_cache_idle_release_s=0)
    off.generate(prompt, greedy)
    off.engine.clock = lambda: now[0] + 10 ** 6
    off.engine.idle()
    assert off.engine.kv.num_blocks_written > 0
