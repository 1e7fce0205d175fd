"""What the NixlConnector's scheduler role hands its worker role each step: the
consumer's pulls (`claims.py` plans them, `consumer.py` runs them) and the producer's
newly kept prompts and states (`kept_prompts.py` decides them, `producer.py` holds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrecover.kv_transfer.base import KVConnectorMetadata
from kvrecover.kv_transfer.p2p.params import RemoteReference
from kvrecover.kv_transfer.p2p.states import RemoteState


@dataclass
class Pull:
    """One request's pull in a step: its local `block_ids` <- the producer's
    `remote_block_ids` (pairwise, every group's; `remote_slots` the (group, position)
    the reference gives each), `missing`: local blocks of the claim the producer does
    not hold (invalid without a read); the producer checks each slot and the chain hash
    of prompt block `last_position`."""

    request_id: str
    block_ids: list[int]
    remote_block_ids: list[int]
    remote_slots: list[tuple[int, int]]
    missing: list[int]
    reference: RemoteReference
    last_position: int
    last_block_hash: str
    is_async: bool
    # A hybrid's: the state to pull with the blocks, at this position (`states.py`);
    # the worker's check sets `remote_state`, its read and verification `state_payload`.
    state_position: int | None = None
    remote_state: RemoteState | None = None
    state_payload: bytes | None = None


@dataclass
class NixlMetadata(KVConnectorMetadata):
    """A step's pulls and unread references to release (consumer) and newly kept prompts
    (producer: handle -> (each group's kept block ids by position, hex chain hash of each
    position)); a hybrid producer's states to copy out after the step (request id,
    checkpoint slot, position), to keep (handle -> (request id, position)) and to forget
    (request ids)."""

    pulls: list[Pull] = field(default_factory=list)
    # References a request reads nothing from (a full local hit): checked, then released.
    releases: list[Pull] = field(default_factory=list)
    holds: dict[str, tuple[tuple[tuple[int, ...], ...], list[str]]] = field(
        default_factory=dict)
    state_captures: list[tuple[str, int, int]] = field(default_factory=list)
    state_holds: dict[str, tuple[str, int]] = field(default_factory=dict)
    state_drops: list[str] = field(default_factory=list)

    def loads_by_request(self) -> dict[str, tuple[list[int], bool]]:
        return {p.request_id: (p.block_ids + p.missing, p.is_async) for p in self.pulls}
