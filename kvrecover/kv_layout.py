"""The KV vocabulary every layer shares: cache layout, block hashes, block arithmetic.

The engine (block pool, scheduler), the worker (cache tensors) and the KV
connectors all import this module and nothing of each other for these facts, so
`kv_transfer/` never needs `engine/` at run time.

A full block is named by a chain hash, `hash(parent_hash, block token ids)`:
equal hashes mean equal prefixes, in every process and on every machine, which
makes the hash both the prefix-cache key and the key of stored KV.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrecover.kv_groups import KVCacheGroup, groups_signature, single_group

NULL_BLOCK_ID = 0  # never allocated: padding in block tables points here


@dataclass(frozen=True)
class KVCacheLayout:
    """The engine's KV cache layout; KV stored under another layout is never loaded.

    Under tensor parallelism each rank has its own layout: `num_kv_heads` is the
    rank's own KV heads and the fingerprint names the size and the rank, so KV one
    rank stored is never loaded by another rank, nor at another size.
    """

    model_identity: str
    dtype: torch.dtype
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    # The KV cache groups (`kv_groups.py`); empty: one full-attention group of all layers.
    groups: tuple[KVCacheGroup, ...] = ()

    @property
    def kv_groups(self) -> tuple[KVCacheGroup, ...]:
        """The groups, at least one; a block id holds one group's layers."""
        return self.groups or single_group(self.num_layers)

    @property
    def has_recurrent_layers(self) -> bool:
        """Whether some layers are in no KV cache group (linear attention: a recurrent
        state per request instead of KV)."""
        return self.num_layers > sum(len(g.layer_indices) for g in self.kv_groups)

    @property
    def num_cache_tensors(self) -> int:
        """Layers one block id spans: the KV cache has this many tensors (S)."""
        return max(len(g.layer_indices) for g in self.kv_groups)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of one layer: [2 (K, V), block_size, kv_heads, head_dim]."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block id across the cache tensors (all layers of one group)."""
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim
        return self.num_cache_tensors * per_layer * self.dtype.itemsize

    @property
    def fingerprint(self) -> str:
        """A digest of everything above; part of every stored key and header."""
        text = (
            f"{self.model_identity}|{self.dtype}|{self.block_size}|"
            f"{self.num_layers}|{self.num_kv_heads}|{self.head_dim}"
        )
        if self.tensor_parallel_size > 1:  # size 1 keeps the digests stored before ranks
            text += f"|tp{self.tensor_parallel_size}|rank{self.tensor_parallel_rank}"
        if self.kv_groups != single_group(self.num_layers):
            text += f"|groups={groups_signature(self.kv_groups)}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def stores_state_at(boundary: int, num_prompt_tokens: int, block_size: int,
                    interval: int) -> bool:
    """Whether a producer's store connector keeps a hybrid prompt's recurrent state at
    block boundary `boundary`: the prompt's last loadable one (where a consumer's claim
    ends) and every `interval`-th before it (K, `KVTransferConfig.state_interval_blocks`).
    The connector saves these (`StoreStates.plan_saves`); the engine's `StateCheckpoints`
    gives them checkpoint slots first."""
    last_loadable = (num_prompt_tokens - 1) // block_size
    return 0 < boundary and (boundary == last_loadable
                             or boundary < last_loadable and boundary % interval == 0)


def resume_points(first: int, last: int, interval: int) -> range:
    """The block boundaries strictly inside a load of blocks [first, last) whose stored
    recurrent state a failed load of a hybrid may resume from (rule 8): the multiples of
    `interval` (K, `KVTransferConfig.state_interval_blocks`) in (first, last), ascending.

    The connector's scheduler role gives a load these (`StoreStates.plan_load`); its
    worker role and the engine's `StateCheckpoints` pick one with `latest_resume_point`,
    so the state the worker keeps is the one the scheduler expects.
    """
    return range((first // interval + 1) * interval, last, interval)


def latest_resume_point(points: Sequence[int], first_invalid: int) -> int | None:
    """The latest of `points` (ascending block boundaries, as `resume_points` gives) at
    or before block boundary `first_invalid` (the start of the first invalid block), or
    None when none is."""
    index = bisect_right(points, first_invalid)
    return points[index - 1] if index else None


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chain hash of one full block; stable across processes and machines."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"\0" * 16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


def group_block_key(block_hash: bytes, group: int) -> bytes:
    """The stored key of KV cache group `group`'s block of this chain hash: the hash
    itself for group 0 (a model of one group stores what it always stored), a digest
    of hash and group for the others."""
    if group == 0:
        return block_hash
    return hashlib.blake2b(block_hash + group.to_bytes(4, "little"), digest_size=16).digest()


def update_block_hashes(block_hashes: list[bytes], token_ids: Sequence[int], block_size: int) -> None:
    """Extend `block_hashes` to cover every full block of `token_ids`."""
    for index in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[-1] if block_hashes else None
        start = index * block_size
        block_hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
