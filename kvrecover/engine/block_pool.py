"""Fixed-size KV blocks: allocation, reference counts and the prefix cache.

A full block is identified by its chain hash (`kv_layout.hash_block_tokens`), so
equal hashes mean equal prefixes. The token ids are stored beside the hash and
compared on every hit, which rules out collisions. Freed blocks keep their hash
and stay hit-able until they are reused (least recently freed first).

All KV cache groups (`kv_groups.py`) share the pool: a block id belongs to one group
at a time, and the prefix cache is keyed by (group, hash).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvrecover.kv_layout import NULL_BLOCK_ID


@dataclass(slots=True)  # tens of thousands exist: slots make creating them faster
class KVCacheBlock:
    """One block of the KV cache and its prefix-cache identity."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    group: int = 0  # the KV cache group it is cached for (meaningful with a hash)


class BlockPool:
    """Owns all blocks: the free list (LRU order) and each group's hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool, num_groups: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b.block_id != NULL_BLOCK_ID
        )
        self._cached: list[dict[bytes, KVCacheBlock]] = [{} for _ in range(num_groups)]

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out now (cached-but-unused ones included)."""
        return len(self._free)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int],
               group: int = 0) -> KVCacheBlock | None:
        """The group's cached block with this hash and exactly these tokens, if any."""
        block = self._cached[group].get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, block: KVCacheBlock) -> None:
        """Take a reference on a (possibly free) cached block."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def allocate(self, count: int) -> list[KVCacheBlock]:
        """Hand out `count` fresh blocks, evicting least recently freed cached ones."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        blocks = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self.uncache(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def release(self, block: KVCacheBlock) -> None:
        """Drop one reference; a block nobody holds becomes free (and stays cached)."""
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = block

    def cache(self, block: KVCacheBlock, block_hash: bytes, token_ids: Sequence[int],
              group: int = 0) -> None:
        """Register a full, valid block of `group` under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        cached = self._cached[group]
        if block_hash in cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.group = group
        cached[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's hash so no request can hit it any more."""
        cached = self._cached[block.group]
        if block.block_hash is not None and cached.get(block.block_hash) is block:
            del cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
