"""Free KV blocks' pages go back to the OS under memory pressure (memory/pressure.py) on the real pool tensors."""

from __future__ import annotations

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
