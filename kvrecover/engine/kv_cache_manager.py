"""Per-request block tables on top of the block pool.

Only block operations live here; what to do about a failed block is decided in
`engine/recovery.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvrecover.engine.block_pool import BlockPool, KVCacheBlock
from kvrecover.engine.request import Request
from kvrecover.kv_layout import blocks_needed, update_block_hashes


class KVCacheManager:
    """Gives requests blocks, finds their prefix-cache hits and registers full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)

    def block(self, block_id: int) -> KVCacheBlock:
        return self.pool.blocks[block_id]

    def find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        """Leading full blocks of the request found in the prefix cache.

        Never covers the whole sequence: the last token must be computed to get logits.
        """
        if not self.pool.enable_caching:
            return []
        update_block_hashes(request.block_hashes, request.token_ids, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            start = index * self.block_size
            block = self.pool.lookup(block_hash, request.token_ids[start : start + self.block_size])
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, request: Request, num_tokens: int, hits: Sequence[KVCacheBlock]) -> bool:
        """Whether `request` (holding its blocks plus `hits`) can grow to `num_tokens`."""
        held = len(request.block_ids) + len(hits)
        free_hits = sum(1 for b in hits if b.ref_count == 0)
        needed = blocks_needed(num_tokens, self.block_size) - held
        return needed <= self.pool.num_free_blocks - free_hits

    def allocate(self, request: Request, num_tokens: int, hits: Sequence[KVCacheBlock] = ()) -> bool:
        """Take the hit blocks, then enough fresh blocks to hold `num_tokens` tokens."""
        if not self.can_allocate(request, num_tokens, hits):
            return False
        if hits:
            for block in hits:
                self.pool.touch(block)
                request.block_ids.append(block.block_id)
            # Only hit blocks are cached already; a fresh block (possibly partly
            # computed) is registered by cache_computed_blocks once it is full.
            request.num_cached_blocks = max(request.num_cached_blocks, len(request.block_ids))
        needed = blocks_needed(num_tokens, self.block_size) - len(request.block_ids)
        if needed > 0:
            request.block_ids.extend(b.block_id for b in self.pool.allocate(needed))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register every full block below `num_computed_tokens` in the prefix cache."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return
        update_block_hashes(request.block_hashes, request.token_ids, self.block_size)
        for index in range(request.num_cached_blocks, num_full):
            start = index * self.block_size
            self.pool.cache(
                self.block(request.block_ids[index]),
                request.block_hashes[index],
                request.token_ids[start : start + self.block_size],
            )
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first so the tail is evicted first."""
        self.release_blocks(self.take_blocks(request, 0))

    def uncache_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (ids outside the pool are ignored)."""
        blocks = self.pool.blocks
        for block_id in block_ids:
            if 0 < block_id < len(blocks):
                self.pool.uncache(blocks[block_id])

    def make_private_from(self, request: Request, first_block_index: int) -> None:
        """Prepare the request to rewrite its blocks from `first_block_index` on.

        A block only this request holds is rewritten in place and leaves the prefix
        cache; a shared one is swapped for a fresh block, so no other request ever
        sees a half-rewritten block. Without a spare block the tail is dropped and
        allocated again when the request grows.
        """
        request.num_cached_blocks = min(request.num_cached_blocks, first_block_index)
        for index in range(first_block_index, len(request.block_ids)):
            block = self.block(request.block_ids[index])
            if block.ref_count == 1:
                self.pool.uncache(block)
                continue
            if self.pool.num_free_blocks == 0:
                self.release_blocks(self.take_blocks(request, index))
                return
            self.pool.release(block)
            request.block_ids[index] = self.pool.allocate(1)[0].block_id

    def take_blocks(self, request: Request, first_block_index: int) -> list[int]:
        """Detach the request's blocks from `first_block_index` on; the caller now holds
        their references (and must `release_blocks` them)."""
        taken = request.block_ids[first_block_index:]
        del request.block_ids[first_block_index:]
        request.num_cached_blocks = min(request.num_cached_blocks, first_block_index)
        return taken

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, tail first (see `free`)."""
        for block_id in reversed(block_ids):
            self.pool.release(self.block(block_id))
