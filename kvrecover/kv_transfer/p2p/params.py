"""The P2P reference (`kv_transfer_params`): vLLM's NixlConnector field names.

A producer hands one out with each kept prompt (`RequestOutput.kv_transfer_params`);
a consumer gets it back on a request (`SamplingParams.kv_transfer_params`, or the
HTTP body's `kv_transfer_params`) and pulls the blocks it names. It is untrusted input
(rule 10): `parse_reference` checks every field's type and range and raises a
ValueError naming the field; what it cannot check (that the producer still holds those
blocks for that request, with that content) the producer's side channel and the
checksums decide at pull time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_BLOCKS = 1 << 20  # more block ids than any cache holds: refused before a read is built


@dataclass(frozen=True)
class RemoteReference:
    """What a consumer pulls: `block_ids` of the producer `engine_id` at host:port, kept
    there for its request `request_id`, with the producer's layout `fingerprint`."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    tp_size: int
    fingerprint: str

    def as_params(self) -> dict[str, Any]:
        """The dict a consumer's request carries (vLLM's names, plus our fingerprint)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": list(self.block_ids),
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "kv_fingerprint": self.fingerprint,
        }


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
    if (not isinstance(block_ids, list) or not 0 < len(block_ids) <= MAX_BLOCKS
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block_ids)):
        raise ValueError("kv_transfer_params.remote_block_ids must be a non-empty list of "
                         f"positive block ids, got {block_ids!r:.80}")
    return RemoteReference(
        engine_id=_text(params, "remote_engine_id"),
        request_id=_text(params, "remote_request_id"),
        block_ids=tuple(block_ids),
        host=_text(params, "remote_host"),
        port=_integer(params, "remote_port", 1, 65535),
        tp_size=_integer(params, "tp_size", 1, 1),
        fingerprint=_text(params, "kv_fingerprint"),
    )
