"""The producers a consumer rank reads from, as their handshakes describe them.

A producer's handshake answer (`side_channel.py`) is untrusted input: `parse_handshake`
accepts it only when its KV layout, cache regions, memory and checksum algorithm are
ones this engine can read and check, and registers its NIXL agent metadata, giving a
`Peer`. `Peers` keeps one per producer engine and handshakes again when that engine
answers with another agent (it restarted: its old regions and references are gone).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.p2p.checksums import ALGORITHMS
from kvrecover.kv_transfer.p2p.staging import half_nbytes


@dataclass
class Peer:
    """A producer agent as its handshake described it: where its cache lies and how its
    blocks are checksummed."""

    agent: str
    num_blocks: int
    block_half_nbytes: int
    regions: list[tuple[int, int]]  # each cache tensor's (K base, V base) address
    memory: str  # NIXL's memory type of the producer's cache: "DRAM" or "VRAM"
    device_id: int
    checksum: str  # the producer's algorithm (`checksums.py`)


def parse_handshake(answer: dict[str, Any], layout: KVCacheLayout,
                    caches: list[torch.Tensor], agent: Any) -> Peer:
    """The peer a producer's handshake `answer` describes, its agent metadata added to
    this rank's NIXL `agent`; raises ValueError (or a KeyError or TypeError for a
    missing or mistyped field) when it is refused or does not match `layout` and
    `caches`."""
    if answer.get("ok") is not True:
        raise ValueError(f"handshake refused: {answer.get('reason')}")
    if answer.get("fingerprint") != layout.fingerprint or \
            answer.get("block_size") != layout.block_size:
        raise ValueError("the producer's KV layout is not this engine's")
    regions = answer.get("regions")
    if (not isinstance(regions, list) or len(regions) != len(caches)
            or answer.get("block_half_nbytes") != half_nbytes(caches)):
        raise ValueError("the producer's cache regions do not match this engine's")
    memory, device_id, checksum = (answer.get(k) for k in ("memory", "device_id",
                                                          "checksum"))
    if memory not in ("DRAM", "VRAM") or not isinstance(device_id, int) \
            or isinstance(device_id, bool) or device_id < 0:
        raise ValueError(f"the producer's cache memory is unknown: {memory!r} "
                         f"device {device_id!r}")
    if checksum not in ALGORITHMS:
        raise ValueError(f"the producer's checksum algorithm is unknown: {checksum!r}")
    added = agent.add_remote_agent(bytes.fromhex(str(answer["metadata"])))
    name = added.decode() if isinstance(added, bytes) else str(added)
    if name != answer.get("agent"):
        raise ValueError("the producer's agent metadata names another agent")
    return Peer(name, int(answer["num_blocks"]), int(answer["block_half_nbytes"]),
                [(int(k), int(v)) for k, v in regions], str(memory), device_id,
                str(checksum))


class Peers:
    """The peer of each producer engine this rank has handshaken, by engine id."""

    def __init__(self) -> None:
        self._by_engine: dict[str, Peer] = {}

    def of(self, engine_id: str, agent: object, handshake: Callable[[], Peer]) -> Peer:
        """The peer of `engine_id`, whose check just named `agent`: the known one, or
        one `handshake` gives when the engine is new or its agent is another (a restart),
        which replaces it."""
        peer = self._by_engine.get(engine_id)
        if peer is None or peer.agent != agent:
            peer = handshake()
            self._by_engine[engine_id] = peer
        return peer
