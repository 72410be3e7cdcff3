"""BlockPool: the KV cache's fixed-size blocks, their reference counts, the free queue and the prefix cache.

Invariants:
- A block is free iff its ref_cnt == 0 (block 0 excepted: it is reserved as the null block). Free blocks wait in
  one of three queues, taken in this order:
  1. written blocks that hold nothing worth keeping (no cached prefix): the most recently freed first, as its
     pages are resident and warm;
  2. blocks never written (or whose pages were released): the KV pool is allocated lazily, so taking one makes
     its pages resident;
  3. blocks holding a cached prefix, in NUM_TIERS queues: the lowest tier first, each oldest freed first (LRU
     eviction). Blocks are freed into the last tier unless the caller knows a later request is less likely to
     want them (the window pool's blocks a running request leaves behind, core/kv_cache_manager.py), so that
     those, not the other cached blocks, make room. With `last_tier_cap`, the last tier's oldest blocks beyond
     it move down a tier (they have waited there longest without a hit), so that it cannot starve the others.
  So without prefix caching the pool's resident part stays at the most blocks ever in use at once (before,
  blocks went round the whole pool, and RSS grew toward all of it on a one-request workload), and with it, the
  cache keeps its blocks until no other free block is left.
- A block with a block_hash is findable in `cached_blocks` until it is taken from the free queues for reuse.
- num_blocks_written counts the distinct blocks handed out since their pages were last released: those are the
  blocks whose pages are resident (memory/rss.py holds RSS to the plan with it; release_free_blocks() gives free
  blocks' pages back under memory pressure).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Key of a full block: chained hash plus the block's own token ids (equality settles collisions)."""

    hash_value: int
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    """Hash of a full block given its parent's hash: a 128-bit BLAKE2b digest of the parent's and the tokens, the
    same in every process. Python's hash() of the tuple was 61 bits and not made to resist a crafted prompt whose
    chain meets another tenant's (the block's own tokens are compared, its history only by this value), which is
    why vLLM moved its prefix-cache keys to SHA-256 (advisory GHSA-rm76-4mrf-v9r8; the default since v0.10.2). About
    2 us a block here (QA-AA)."""
    parent_value = parent.hash_value if parent is not None else 0
    digest = hashlib.blake2b(parent_value.to_bytes(16, "little") + array("q", token_ids).tobytes(), digest_size=16)
    return BlockHash(int.from_bytes(digest.digest(), "little"), token_ids)


def salt_hash(salt: str | None) -> BlockHash | None:
    """The parent of a salted request's first block (vLLM's cache_salt), so that its blocks' keys differ from
    every other salt's and from unsalted ones; a stable digest, as block keys must agree across processes."""
    if salt is None:
        return None
    digest = hashlib.sha256(salt.encode()).digest()
    return BlockHash(int.from_bytes(digest[:16], "little"), ())


NUM_TIERS = 3  # the queues of cached free blocks (the module docstring)


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every KV block. Block 0 is never handed out (padding slots may point at it)."""

    def __init__(self, num_blocks: int, enable_caching: bool, last_tier_cap: int | None = None) -> None:
        """`last_tier_cap`: the most blocks the last tier keeps; beyond it, its oldest move down a tier."""
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.last_tier_cap = last_tier_cap
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        # The free queues (see the module docstring), block_id -> block in the order they were freed.
        # OrderedDict gives O(1) removal from the middle (a cache hit on a free block).
        self._free_written: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._free_unwritten: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._free_cached: list[OrderedDict[int, KVCacheBlock]] = [OrderedDict() for _ in range(NUM_TIERS)]
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self._written: set[int] = set()  # ids of the blocks handed out since their pages were last released

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_written) + len(self._free_unwritten) + sum(len(tier) for tier in self._free_cached)

    @property
    def num_blocks_written(self) -> int:
        return len(self._written)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks that are referenced by a request (0.0 .. 1.0)."""
        usable = self.num_blocks - 1
        return (usable - self.num_free_blocks) / usable

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` free blocks (evicting their cached contents); caller checked availability."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            if self._free_written:
                _, block = self._free_written.popitem(last=True)
            elif self._free_unwritten:
                _, block = self._free_unwritten.popitem(last=False)
            else:
                _, block = next(tier for tier in self._free_cached if tier).popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            self._written.add(block.block_id)
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling them out of the free queue if unused."""
        for block in blocks:
            if block.ref_cnt == 0:
                next(tier for tier in self._free_cached if block.block_id in tier).pop(block.block_id)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a block whose tokens are all known; the first block with a given hash wins."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, block)

    def free_blocks(self, blocks: list[KVCacheBlock], tier: int = NUM_TIERS - 1) -> None:
        """Drop one reference from each block. Pass blocks in eviction order (first = evicted first). The cached
        ones among them wait in `tier`'s queue (the module docstring)."""
        cached_queue = self._free_cached[tier]
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if not self.enable_caching or self.cached_blocks.get(block.block_hash) is not block:
                    block.block_hash = None  # nothing a later request can find in it
                    self._free_written[block.block_id] = block
                else:
                    cached_queue[block.block_id] = block
        last = self._free_cached[-1]
        while self.last_tier_cap is not None and len(last) > self.last_tier_cap:
            block_id, block = last.popitem(last=False)
            self._free_cached[-2][block_id] = block

    def release_free_blocks(self) -> list[int]:
        """Every free block whose pages are resident: forget its cached hash, mark it unwritten and return its id
        (the caller returns its pages to the OS, memory/pressure.py). Blocks in use are untouched."""
        released = [block_id for block_id in self._written if self.blocks[block_id].ref_cnt == 0]
        for block_id in released:
            block = self.blocks[block_id]
            self._evict(block)
            self._free_written.pop(block_id, None)
            for tier in self._free_cached:
                tier.pop(block_id, None)
            self._free_unwritten[block_id] = block
        self._written.difference_update(released)
        return released

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
        self.cached_blocks.clear()
        for tier in self._free_cached:
            self._free_written.update(tier)
            tier.clear()
        return True
