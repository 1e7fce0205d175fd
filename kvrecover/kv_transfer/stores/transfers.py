"""The records a store connector's scheduler role hands its worker role each step:
the blocks to load or save (`BlockTransfer`), the recurrent states to store
(`StateSave`), and the step's metadata holding both."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrecover.kv_transfer.base import KVConnectorMetadata


@dataclass
class BlockTransfer:
    """Blocks of one request to load or save: cache block ids and their store keys."""

    request_id: str
    block_ids: list[int]
    keys: Sequence[bytes]  # slices of the request's block hashes (a tuple)
    is_async: bool = False
    # A hybrid model's load: the chain hash of the block that ends where it ends (its
    # recurrent state's name, `state_entries`), and that position.
    state_hash: bytes | None = None
    state_position: int = 0
    # And where a failed load resumes (`store_states.StoreStates.keep_resume_state`): the
    # block index of each of `block_ids`, and (position, chain hash of the block ending
    # there) of every stored-state boundary strictly inside the load, in order.
    block_positions: list[int] = field(default_factory=list)
    resume_points: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class StorageConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    state_saves: list[StateSave] = field(default_factory=list)

    def loads_by_request(self) -> dict[str, tuple[list[int], bool]]:
        return {t.request_id: (t.block_ids, t.is_async) for t in self.loads}

    def num_save_blocks(self) -> int:
        return sum(len(t.block_ids) for t in self.saves)


@dataclass
class StateSave:
    """A recurrent state to store: the checkpoint slot the step writes it to, and the
    chain hash of the block that ends at its boundary."""

    request_id: str
    slot: int
    block_hash: bytes
