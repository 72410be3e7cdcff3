"""KVCacheManager: decides whether memory allows a request to run, and which blocks it owns.

Protocol with the scheduler: `get_computed_blocks` (prefix-cache lookup), `allocate_slots`
(None = not enough free blocks), `record_lookup` once the request is admitted, and finally `free`. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens, salt_hash
from pagedserve.request import Request


@dataclass
class ComputedBlocks:
    """Prefix-cache hit for a waiting request."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and the hit counters (after warm-up, whose prompts are not users')."""
        self.pool.reset_prefix_cache()
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_blocks_written(self) -> int:
        """Blocks whose pages hold K/V (memory/rss.py's expectation of the pool's resident bytes)."""
        return self.pool.num_blocks_written

    def release_free_blocks(self) -> list[int]:
        """Mark every free block unwritten and return their ids: the caller gives their pages back."""
        return self.pool.release_free_blocks()

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds (the null block excepted): one request never grows past it."""
        return (self.pool.num_blocks - 1) * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its known tokens (incremental)."""
        bs = self.block_size
        hashes = request.block_hashes
        for start in range(len(hashes) * bs, request.num_tokens - bs + 1, bs):
            parent = hashes[-1] if hashes else salt_hash(request.sampling_params.cache_salt)  # the first block's
            hashes.append(hash_block_tokens(parent, tuple(request.all_token_ids[start:start + bs])))

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of full blocks, leaving at least one token to compute (for logits)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return ComputedBlocks()
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return ComputedBlocks(hit, len(hit) * self.block_size)

    def record_lookup(self, request: Request, computed: ComputedBlocks) -> None:
        """Count an admitted request's lookup in the prefix-cache stats, as vLLM's: once per request (a lookup
        for a request the pool could not take yet is retried every step), and not again after a preemption (its
        own blocks would count as hits)."""
        if self.enable_caching and request.sampling_params.prompt_logprobs is None and not request.num_preemptions:
            self.stats.num_queries += request.num_tokens
            self.stats.num_hits += computed.num_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> list[KVCacheBlock] | None:
        """Give the request blocks for `num_new_tokens` more tokens; None if the pool is too short."""
        computed_blocks = computed.blocks if computed else []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_known = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = self.num_blocks_for(num_known + num_new_tokens)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(computed_blocks))
        # Cache hits sitting in the free queue stop being free once touched.
        num_reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_reclaimed:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        req_blocks.extend(computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            # K/V of these tokens are written this step, before any attention reads them.
            self._cache_full_blocks(request, min(num_known + num_new_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release every block of the request; tail blocks become the first to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]
