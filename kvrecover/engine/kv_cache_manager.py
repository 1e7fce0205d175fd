"""Per-request block tables, one per KV cache group, on top of one shared block pool.

Only block operations live here; what to do about a failed block is decided in
`engine/recovery.py`. Every table has one entry per block position of the request.
A full-attention group holds every block; a windowed group (`kv_groups.py`) holds
only the blocks a future query can read and puts the null block in the others,
releasing them to the pool as the request advances (never while a load into the
request is pending: recovery may still need them).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from kvrecover.engine.block_pool import BlockPool, KVCacheBlock
from kvrecover.engine.request import Request
from kvrecover.kv_groups import KVCacheGroup
from kvrecover.kv_layout import NULL_BLOCK_ID, blocks_needed, update_block_hashes

FULL_ATTENTION = (KVCacheGroup(None, ()),)


@dataclass
class PrefixHit:
    """A prefix found in the prefix cache: `num_tokens` (block-aligned) and, per group,
    the block of each position below it (None where the group needs none)."""

    num_tokens: int = 0
    blocks: list[list[KVCacheBlock | None]] = field(default_factory=list)

    def __len__(self) -> int:
        """The number of block positions hit."""
        return len(self.blocks[0]) if self.blocks else 0


class KVCacheManager:
    """Gives requests blocks in every group, finds their prefix-cache hits and registers
    full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 groups: Sequence[KVCacheGroup] = FULL_ATTENTION, block_nbytes: int = 0) -> None:
        self.block_size = block_size
        self.block_nbytes = block_nbytes  # bytes of one block id (the stats count loads in it)
        self.groups = tuple(groups)
        self.windowed = [g.window is not None for g in self.groups]
        self.pool = BlockPool(num_blocks, enable_prefix_caching, len(self.groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def block(self, block_id: int) -> KVCacheBlock:
        return self.pool.blocks[block_id]

    # ----- prefix cache --------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest block-aligned prefix every group can resume at from the prefix
        cache: a full group needs all its blocks, a windowed one those its window reads.

        Never covers the whole sequence: the last token must be computed to get logits.
        """
        if not self.pool.enable_caching:
            return PrefixHit(0, [[] for _ in self.groups])
        update_block_hashes(request.block_hashes, request.token_ids, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = [self._cached_blocks(request, g, max_blocks) for g in range(self.num_groups)]
        limit = max_blocks
        for g, blocks in enumerate(found):
            if not self.windowed[g]:
                limit = min(limit, blocks.index(None) if None in blocks else len(blocks))
        for num_blocks in range(limit, 0, -1):
            end = num_blocks * self.block_size
            firsts = [group.first_needed_block(end, self.block_size) for group in self.groups]
            if all(b is not None for g, blocks in enumerate(found)
                   for b in blocks[firsts[g]:num_blocks]):
                nothing: list[KVCacheBlock | None] = [None]
                return PrefixHit(end, [
                    nothing * firsts[g] + blocks[firsts[g]:num_blocks]
                    for g, blocks in enumerate(found)
                ])
        return PrefixHit(0, [[] for _ in self.groups])

    def _cached_blocks(self, request: Request, group: int, max_blocks: int
                       ) -> list[KVCacheBlock | None]:
        """The group's cached block of each position below `max_blocks` (None: a miss);
        a full group stops at its first miss."""
        blocks: list[KVCacheBlock | None] = []
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            start = index * self.block_size
            block = self.pool.lookup(
                block_hash, request.token_ids[start : start + self.block_size], group)
            blocks.append(block)
            if block is None and not self.windowed[group]:
                break
        return blocks

    # ----- allocation ------------------------------------------------------------------
    def can_allocate(self, request: Request, num_tokens: int, hits: PrefixHit | None = None,
                     load_end: int | None = None) -> bool:
        """Whether `request` (holding its blocks plus `hits`) can grow to `num_tokens`
        (see `allocate` for `load_end`)."""
        needed = 0
        free_hits = 0
        for g, table in enumerate(request.block_tables):
            if hits is not None and hits.blocks:
                free_hits += sum(1 for b in hits.blocks[g] if b is not None and b.ref_count == 0)
            needed += len(self._positions_to_fill(request, g, table, num_tokens, hits, load_end))
        return needed <= self.pool.num_free_blocks - free_hits

    def allocate(self, request: Request, num_tokens: int, hits: PrefixHit | None = None,
                 load_end: int | None = None) -> bool:
        """Take the hit blocks, then enough fresh blocks to hold `num_tokens` tokens in
        every group. `load_end`: a connector is about to load the request's tokens up to
        there, so a windowed group gets the blocks of that load (`first_loaded_block`).
        A windowed group first releases the blocks no future query reads, unless a load
        into the request is pending."""
        if request.pending_external is None and load_end is None:
            self._release_unreachable(request)
        if not self.can_allocate(request, num_tokens, hits, load_end):
            return False
        tables = request.block_tables
        if hits is not None and len(hits):
            for g, blocks in enumerate(hits.blocks):
                for block in blocks:
                    if block is None:
                        tables[g].append(NULL_BLOCK_ID)
                    else:
                        self.pool.touch(block)
                        tables[g].append(block.block_id)
            # Only hit blocks are cached already; a fresh block (possibly partly
            # computed) is registered by cache_computed_blocks once it is full.
            request.num_cached_blocks = max(request.num_cached_blocks, len(hits))
        end = blocks_needed(num_tokens, self.block_size)
        for g, table in enumerate(tables):
            positions = self._positions_to_fill(request, g, table, num_tokens, hits, load_end)
            if len(table) < end:  # every table has one entry per block position
                table.extend([NULL_BLOCK_ID] * (end - len(table)))
            if positions:
                for position, block in zip(positions, self.pool.allocate(len(positions))):
                    table[position] = block.block_id
        return True

    def _positions_to_fill(self, request: Request, group: int, table: list[int],
                           num_tokens: int, hits: PrefixHit | None, load_end: int | None
                           ) -> range | list[int]:
        """Positions of the group's table that need a fresh block to hold `num_tokens`."""
        end = blocks_needed(num_tokens, self.block_size)
        held = len(hits) if hits is not None and len(hits) else len(table)
        if not self.windowed[group]:
            return range(held, end)
        computed = max(request.num_computed_tokens, hits.num_tokens if hits is not None else 0)
        kv_group = self.groups[group]
        first = (kv_group.first_loaded_block(load_end, self.block_size) if load_end is not None
                 else kv_group.first_needed_block(computed, self.block_size))
        start = max(first, computed // self.block_size)
        return [i for i in range(start, end) if i >= held or table[i] == NULL_BLOCK_ID]

    def _release_unreachable(self, request: Request) -> None:
        """Release every windowed group's blocks that no query from the request's
        `num_computed_tokens` on reads (they become the null block)."""
        for g, table in enumerate(request.block_tables):
            if not self.windowed[g]:
                continue
            first = self.groups[g].first_needed_block(request.num_computed_tokens, self.block_size)
            for index in range(min(first, len(table))):
                if table[index] != NULL_BLOCK_ID:
                    self.pool.release(self.block(table[index]))
                    table[index] = NULL_BLOCK_ID

    def cache_computed_blocks(self, request: Request) -> None:
        """Register every full block below `num_computed_tokens` in the prefix cache."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return
        update_block_hashes(request.block_hashes, request.token_ids, self.block_size)
        for g, table in enumerate(request.block_tables):
            for index in range(request.num_cached_blocks, num_full):
                if table[index] == NULL_BLOCK_ID:
                    continue
                start = index * self.block_size
                self.pool.cache(
                    self.block(table[index]),
                    request.block_hashes[index],
                    request.token_ids[start : start + self.block_size],
                    g,
                )
        request.num_cached_blocks = num_full

    def max_blocks_needed(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, in all groups
        (a windowed group: about the blocks of a load with its margin)."""
        full = blocks_needed(num_tokens, self.block_size)
        return sum(
            full if g.window is None else min(full, g.first_loaded_span(self.block_size))
            for g in self.groups
        )

    def blocks_held(self, request: Request) -> list[int]:
        """How many blocks the request holds in each group (the null block not counted)."""
        return [sum(1 for b in table if b != NULL_BLOCK_ID) for table in request.block_tables]

    # ----- giving blocks back ------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first so the tail is evicted first."""
        self.release_blocks(self.take_blocks(request, 0))

    def uncache_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (ids outside the pool are ignored)."""
        blocks = self.pool.blocks
        for block_id in block_ids:
            if 0 < block_id < len(blocks):
                self.pool.uncache(blocks[block_id])

    def make_private_from(self, request: Request, first_block_index: int,
                          keep: Collection[int] = ()) -> None:
        """Prepare the request to rewrite its blocks from `first_block_index` on, in
        every group, except the positions in `keep` (valid blocks it will not rewrite).

        A block only this request holds is rewritten in place and leaves the prefix
        cache; a shared one is swapped for a fresh block, so no other request ever
        sees a half-rewritten block. Without a spare block the tail is dropped and
        allocated again when the request grows.
        """
        request.num_cached_blocks = min(request.num_cached_blocks, first_block_index)
        for table in request.block_tables:
            for index in range(first_block_index, len(table)):
                if table[index] == NULL_BLOCK_ID or index in keep:
                    continue  # a windowed gap (`allocate` fills it) or a kept block
                block = self.block(table[index])
                if block.ref_count == 1:
                    self.pool.uncache(block)
                    continue
                if self.pool.num_free_blocks == 0:
                    self.release_blocks(self.take_blocks(request, index))
                    return
                self.pool.release(block)
                table[index] = self.pool.allocate(1)[0].block_id

    def drop_blocks(self, request: Request, block_ids: Iterable[int]) -> None:
        """Release these blocks of the request's tables (they become the null block)."""
        dropped = set(block_ids)
        for table in request.block_tables:
            for index, block_id in enumerate(table):
                if block_id in dropped:
                    self.pool.release(self.block(block_id))
                    table[index] = NULL_BLOCK_ID

    def take_blocks(self, request: Request, first_block_index: int) -> list[int]:
        """Detach the request's blocks from `first_block_index` on, in every group; the
        caller now holds their references (and must `release_blocks` them)."""
        taken: list[int] = []
        for table in request.block_tables:
            taken.extend(b for b in table[first_block_index:] if b != NULL_BLOCK_ID)
            del table[first_block_index:]
        request.num_cached_blocks = min(request.num_cached_blocks, first_block_index)
        return taken

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, tail first (see `free`)."""
        for block_id in reversed(block_ids):
            self.pool.release(self.block(block_id))
