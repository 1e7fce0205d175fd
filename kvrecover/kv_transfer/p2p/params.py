"""The P2P reference (`kv_transfer_params`): vLLM's NixlConnector field names.

A producer hands one out with each kept prompt (`RequestOutput.kv_transfer_params`);
a consumer gets it back on a request (`SamplingParams.kv_transfer_params`, or the
HTTP body's `kv_transfer_params`) and pulls the blocks it names. It is untrusted input
(rule 10): `parse_reference` checks every field's type and range and raises a
ValueError naming the field; what it cannot check (that the producer still holds those
blocks for that request, with that content) the producer's side channel and the
checksums decide at pull time.

`remote_block_ids` is a list of block ids for a model of one full-attention KV cache
group, and a list per group (vLLM's form for several groups) for a model with windows:
every group's list has an entry per prompt block position, the null block (0) where a
windowed group holds none (`kv_groups.py`). A hybrid (recurrent-state) model's reference
also says the block boundary whose state the producer keeps (`kv_state_block`, ours,
`states.py`): a consumer's claim ends there.

At tensor_parallel_size N > 1 (vLLM's convention) `tp_size` is the producer's N,
`remote_port` its rank 0's side channel (rank r serves `remote_port + r`) and
`kv_fingerprint` its rank 0's layout fingerprint; a consumer pulls only from a producer
of its own size, rank r from rank r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_BLOCKS = 1 << 20  # more block ids than any cache holds: refused before a read is built
MAX_GROUPS = 256
MAX_TP_SIZE = 1024  # a producer's tensor-parallel size: rank r serves remote_port + r


@dataclass(frozen=True)
class RemoteReference:
    """What a consumer pulls: `group_block_ids` (per KV cache group, one entry per block
    position, 0 where the group holds none) of the producer `engine_id` at host:port,
    kept there for its request `request_id`, with the producer's layout `fingerprint`
    (its rank 0's); `tp_size`: the producer's tensor-parallel size, its rank r at
    port + r.
    `grouped`: the params carry a list per group (else one flat list: one group);
    `state_block`: a hybrid's boundary (in blocks) whose recurrent state is kept."""

    engine_id: str
    request_id: str
    group_block_ids: tuple[tuple[int, ...], ...]
    host: str
    port: int
    tp_size: int
    fingerprint: str
    grouped: bool = False
    state_block: int | None = None

    def side_channel_port(self, rank: int) -> int:
        """The side channel of the producer's rank `rank` (`rank_side_channel_port`)."""
        return rank_side_channel_port(self.port, rank)

    @property
    def num_blocks(self) -> int:
        """How many block positions of the prompt the reference covers."""
        return len(self.group_block_ids[0])

    def as_params(self) -> dict[str, Any]:
        """The dict a consumer's request carries (vLLM's names, plus our fingerprint)."""
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": ([list(ids) for ids in self.group_block_ids] if self.grouped
                                 else list(self.group_block_ids[0])),
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "kv_fingerprint": self.fingerprint,
        }
        if self.state_block is not None:
            params["kv_state_block"] = self.state_block
        return params


def rank_side_channel_port(base_port: int, rank: int) -> int:
    """The port rank `rank` serves its side channel on (vLLM's convention: base + rank);
    a reference hands out the base port."""
    return base_port + rank


def wants_remote_prefill(params: Any) -> bool:
    """Whether a request's `kv_transfer_params` ask the consumer to pull (vLLM's flag)."""
    return isinstance(params, dict) and params.get("do_remote_prefill") is True


def _text(params: dict, name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value or len(value) > 512:
        raise ValueError(f"kv_transfer_params.{name} must be a non-empty string, got "
                         f"{value!r:.80}")
    return value


def _integer(params: dict, name: str, low: int, high: int) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"kv_transfer_params.{name} must be an integer in [{low}, {high}], "
                         f"got {value!r:.80}")
    return value


def parse_reference(params: Any) -> RemoteReference:
    """The reference in a request's `kv_transfer_params`; ValueError naming the field
    that is missing or of the wrong type or range."""
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    block_ids = params.get("remote_block_ids")
    grouped = isinstance(block_ids, list) and bool(block_ids) and isinstance(block_ids[0], list)
    groups = block_ids if grouped else [block_ids]
    if (not isinstance(groups, list) or not 0 < len(groups) <= MAX_GROUPS
            or not all(_block_list(ids, 0 if grouped else 1) for ids in groups)
            or len({len(ids) for ids in groups}) != 1
            or len(groups) * len(groups[0]) > MAX_BLOCKS):
        raise ValueError("kv_transfer_params.remote_block_ids must be a non-empty list of "
                         "positive block ids, or one list per KV cache group (of equal "
                         f"lengths, 0 where a group holds no block), got {block_ids!r:.80}")
    state_block = params.get("kv_state_block")
    if state_block is not None:
        state_block = _integer(params, "kv_state_block", 1, len(groups[0]))
    port = _integer(params, "remote_port", 1, 65535)
    tp_size = _integer(params, "tp_size", 1, min(MAX_TP_SIZE, 65536 - port))
    return RemoteReference(
        engine_id=_text(params, "remote_engine_id"),
        request_id=_text(params, "remote_request_id"),
        group_block_ids=tuple(tuple(ids) for ids in groups),
        host=_text(params, "remote_host"),
        port=port,
        tp_size=tp_size,
        fingerprint=_text(params, "kv_fingerprint"),
        grouped=grouped,
        state_block=state_block,
    )


def _block_list(ids: Any, lowest: int) -> bool:
    """Whether `ids` is a non-empty list of block ids of at least `lowest`."""
    return (isinstance(ids, list) and 0 < len(ids) <= MAX_BLOCKS
            and all(not isinstance(b, bool) and isinstance(b, int) and b >= lowest for b in ids))
