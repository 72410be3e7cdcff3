"""KVCacheManager: decides whether memory allows a request to run, and which blocks it owns.

Protocol with the scheduler: `get_computed_blocks` (prefix-cache lookup), `allocate_slots`
(None = not enough free blocks), `record_lookup` once the request is admitted, and finally `free`. Pure Python.

Sliding-window layers (Gemma 2/3 and Qwen's max_window_layers on some layers, Mistral and Phi-3 on every one) keep
their K/V in a pool of their own, the window pool, with a block table of their own per request: block i of both
tables holds positions [i x block_size, (i + 1) x block_size). A request holds window blocks only for the positions
its next tokens can see (the last `window` - 1 before them) and its new tokens: the blocks before are given back
after each step (`release_out_of_window`) and at each allocation (the null block takes their place in its table),
so the window layers' K/V of a long context stays at about a window per request instead of growing with the
context. The full-attention layers' pool works as without windows (where every layer has a window, it holds no
K/V: its blocks are bookkeeping). A prefix-cache hit needs every full block of the prefix in the main pool and, in
the window pool, the blocks the window of the first token to compute covers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pagedserve.core.block_pool import NUM_TIERS, BlockHash, BlockPool, KVCacheBlock, hash_block_tokens, salt_hash
from pagedserve.request import Request

# The window pool's tiers (block_pool.py) for the blocks a running request leaves behind its window
# (KVCacheManager._give_back), evicted lowest first; the shared one is the tier of the blocks requests free when
# they finish.
_LEFT_BEHIND_TIER, _PROMPT_TAIL_TIER, _SHARED_TIER = range(NUM_TIERS)


@dataclass
class ComputedBlocks:
    """Prefix-cache hit for a waiting request."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_tokens: int = 0
    # The window pool's blocks of the hit, as the request's window table starts: the null block where the window
    # of the first token to compute does not reach (empty without a window pool).
    window_blocks: list[KVCacheBlock] = field(default_factory=list)


@dataclass
class NewBlocks:
    """The blocks an allocation added to a request's tables (what the runner appends to its block-table rows)."""

    block_ids: list[int]
    window_block_ids: list[int] = field(default_factory=list)


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, num_window_blocks: int = 0,
                 window: int | None = None) -> None:
        """`num_window_blocks` and `window`: the sliding-window layers' pool of their own and their window (see the
        module docstring); 0 and None where every layer's K/V lives in the one pool."""
        if (num_window_blocks > 0) != (window is not None):
            raise ValueError(f"a window pool needs both its blocks and its window, got {num_window_blocks} blocks "
                             f"and window {window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.window = window
        # Half the window pool at most for the tier of finished requests' windows and shared prefixes' (their
        # windows accumulate there when later prompts diverge before them: benchmarks/window_prefix_hits.py).
        self.window_pool = BlockPool(num_window_blocks, enable_caching, num_window_blocks // 2) \
            if window is not None else None
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_window_blocks: dict[str, list[KVCacheBlock]] = {}  # the null block for blocks given back
        self._window_start: dict[str, int] = {}  # each request's first window block not given back
        # Prefix hits counted by the hash of the block they end with, and the hashes of the window blocks of the
        # ends hit twice or more (_count_hit_end; each the most recent, a few window pools' worth)
        self._hit_ends: OrderedDict[BlockHash, int] = OrderedDict()
        self._shared_windows: OrderedDict[BlockHash, None] = OrderedDict()
        # How many leading blocks of each request are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, in both pools, and the hit counters (after warm-up, whose prompts are not
        users'; vLLM's LLM.reset_prefix_cache); False, and nothing forgotten, while requests hold blocks."""
        pools = [self.pool] + ([self.window_pool] if self.window_pool is not None else [])
        if any(pool.num_free_blocks != pool.num_blocks - 1 for pool in pools):
            return False
        for pool in pools:
            pool.reset_prefix_cache()
        self.stats = PrefixCacheStats()
        self._hit_ends.clear()
        self._shared_windows.clear()
        return True

    @property
    def usage(self) -> float:
        """Fraction of the blocks requests hold (vllm:kv_cache_usage_perc): of the fuller pool, the one that
        preempts first, where the window layers have one of their own."""
        return max(self.pool.usage, self.window_pool.usage if self.window_pool is not None else 0.0)

    @property
    def num_blocks_written(self) -> int:
        """Blocks whose pages hold K/V (memory/rss.py's expectation of the pool's resident bytes)."""
        return self.pool.num_blocks_written

    @property
    def num_window_blocks_written(self) -> int:
        """The window pool's blocks whose pages hold K/V (0 without a window pool)."""
        return self.window_pool.num_blocks_written if self.window_pool is not None else 0

    def release_free_blocks(self) -> tuple[list[int], list[int]]:
        """Mark every free block unwritten and return their ids, the main pool's and the window pool's: the
        caller gives their pages back."""
        window = self.window_pool.release_free_blocks() if self.window_pool is not None else []
        return self.pool.release_free_blocks(), window

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
        if self.window_pool is None or not hit:
            return ComputedBlocks(hit, len(hit) * self.block_size)
        num_hit = len(hit)
        while num_hit:  # the longest hit whose first token to compute finds its window in the window pool
            first = self._first_window_block(num_hit * self.block_size)
            found = [self.window_pool.get_cached_block(h) for h in request.block_hashes[first:num_hit]]
            missing = [i for i, block in enumerate(found) if block is None]
            if not missing:
                window_blocks = [self.window_pool.null_block] * first + found
                return ComputedBlocks(hit[:num_hit], num_hit * self.block_size, window_blocks)
            num_hit = first + missing[-1]  # a shorter hit's window must end before the last block missing
        return ComputedBlocks()

    def _first_window_block(self, position: int) -> int:
        """The first window-pool block a token at `position` (or a later one) attends to."""
        return max(0, position - self.window + 1) // self.block_size

    def record_lookup(self, request: Request, computed: ComputedBlocks) -> None:
        """Count an admitted request's lookup in the prefix-cache stats, as vLLM's: once per request (a lookup
        for a request the pool could not take yet is retried every step), and not again after a preemption (its
        own blocks would count as hits)."""
        if self.enable_caching and request.sampling_params.prompt_logprobs is None and not request.num_preemptions:
            self.stats.num_queries += request.num_tokens
            self.stats.num_hits += computed.num_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> NewBlocks | None:
        """Give the request blocks for `num_new_tokens` more tokens; None if a pool is too short. With a window
        pool, the request's window blocks before its new tokens' window go back to it first."""
        computed_blocks = computed.blocks if computed else []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_known = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = self.num_blocks_for(num_known + num_new_tokens)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(computed_blocks))
        # Cache hits sitting in the free queue stop being free once touched.
        num_reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        fits = num_new_blocks <= self.pool.num_free_blocks - num_reclaimed
        if fits and self.window_pool is not None:
            fits = self._window_fits(request, num_known, num_required, computed)
        if not fits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        req_blocks.extend(computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        window_ids = self._allocate_window(request, num_known, num_required, computed) \
            if self.window_pool is not None else []
        if self.enable_caching:
            # K/V of these tokens are written this step, before any attention reads them.
            self._cache_full_blocks(request, min(num_known + num_new_tokens, request.num_tokens))
        return NewBlocks([b.block_id for b in new_blocks], window_ids)

    def _window_fits(self, request: Request, num_known: int, num_required: int,
                     computed: ComputedBlocks | None) -> bool:
        """Whether the window pool has the blocks this allocation needs (after the request's own out-of-window
        blocks went back: they are free for it too)."""
        request_id = request.request_id
        first = self._first_window_block(num_known)
        if request_id in self.req_to_window_blocks:
            held = self.req_to_window_blocks[request_id]
            start = self._window_start[request_id]
            given_back = sum(1 for b in held[start:first] if b is not self.window_pool.null_block and b.ref_cnt == 1)
            return num_required - max(len(held), first) <= self.window_pool.num_free_blocks + given_back
        hit = computed.window_blocks if computed else []
        reclaimed = sum(1 for b in hit if b.ref_cnt == 0)  # cache hits in the free queue stop being free
        return num_required - max(len(hit), first) <= self.window_pool.num_free_blocks - reclaimed

    def _allocate_window(self, request: Request, num_known: int, num_required: int,
                         computed: ComputedBlocks | None) -> list[int]:
        """The window table's part of allocate_slots (checked by _window_fits): give back the blocks before the
        window of the first new token, then add blocks up to `num_required`; the ids of the blocks added."""
        pool, null = self.window_pool, self.window_pool.null_block
        held = self.req_to_window_blocks.get(request.request_id)
        if held is None:  # admitted now: its table starts with the hit's window blocks
            held = self.req_to_window_blocks[request.request_id] = list(computed.window_blocks if computed else [])
            hit = [b for b in held if b is not null]
            pool.touch(hit)
            self._count_hit_end(hit)
            self._window_start[request.request_id] = next((i for i, b in enumerate(held) if b is not null),
                                                          len(held))
        first = self._first_window_block(num_known)
        self._give_back(request, first)
        if len(held) < first:  # a table that starts past the window's blocks: null up to them
            held.extend([null] * (first - len(held)))
        new_blocks = pool.get_new_blocks(max(0, num_required - len(held)))
        held.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def _give_back(self, request: Request, first: int) -> None:
        """Give the window pool back the request's blocks before block `first`, oldest first (the first evicted);
        the null block takes their place. A hit needs the window before its own end, and these wait in the tier
        (block_pool.py) of the hits they may serve: the window of a prefix hits keep ending at (a shared system
        prompt, _count_hit_end) with the blocks requests free when they finish (a conversation's next turn hits
        the window its last turn freed at its end); the two windows before the prompt's end (a new question of up
        to a window about the same document hits the window before the document's end) one tier lower; the
        others, the lowest."""
        request_id = request.request_id
        held, start = self.req_to_window_blocks[request_id], self._window_start[request_id]
        end = min(first, len(held))
        if end <= start:
            return
        prompt_end = -(-request.num_prompt_tokens // self.block_size)
        prompt_tail = range(self._first_window_block(max(0, request.num_prompt_tokens - self.window)), prompt_end)
        tiers: dict[int, list[KVCacheBlock]] = {}
        for i in range(start, end):
            block = held[i]
            if block is not self.window_pool.null_block:
                tier = (_SHARED_TIER if block.block_hash in self._shared_windows
                        else _PROMPT_TAIL_TIER if i in prompt_tail else _LEFT_BEHIND_TIER)
                tiers.setdefault(tier, []).append(block)
        for tier, blocks in sorted(tiers.items()):
            self.window_pool.free_blocks(blocks, tier)
        held[start:end] = [self.window_pool.null_block] * (end - start)
        self._window_start[request_id] = end

    def _count_hit_end(self, window_blocks: list[KVCacheBlock]) -> None:
        """Count a prefix hit by where it ends; from the second hit that ends there on, the window blocks before
        that end are a shared prefix's window (_give_back keeps them with the blocks of finished requests)."""
        if not window_blocks:
            return
        end = window_blocks[-1].block_hash
        self._hit_ends[end] = self._hit_ends.pop(end, 0) + 1
        if self._hit_ends[end] >= 2:
            for block in window_blocks:
                self._shared_windows.pop(block.block_hash, None)
                self._shared_windows[block.block_hash] = None
        for remembered in (self._hit_ends, self._shared_windows):  # the most recent, a few pools' worth
            while len(remembered) > 4 * self.window_pool.num_blocks:
                remembered.popitem(last=False)

    def release_out_of_window(self, request: Request) -> None:
        """After a step: give back the window blocks the request's next tokens no longer see (its computed tokens
        moved on), so that between steps a request holds about a window of them, whatever its last chunk was."""
        if self.window_pool is not None and request.request_id in self.req_to_window_blocks:
            self._give_back(request, self._first_window_block(request.num_computed_tokens))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        window_blocks = self.req_to_window_blocks.get(request.request_id)
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
            if window_blocks is not None and window_blocks[i] is not self.window_pool.null_block:
                self.window_pool.cache_full_block(window_blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release every block of the request; tail blocks become the first to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))
        if self.window_pool is not None:
            self.window_pool.free_blocks(list(reversed(self.req_to_window_blocks.pop(request.request_id, []))))
            self._window_start.pop(request.request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def window_block_ids(self, request_id: str) -> list[int]:
        """The request's window table (0, the null block, where it gave blocks back); empty without a window pool."""
        return [b.block_id for b in self.req_to_window_blocks.get(request_id, [])]
