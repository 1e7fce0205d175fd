"""The KV handoff the proxy speaks to its instances: vLLM's P/D protocol (`kv_transfer_params`).

The proxy asks every prefill to keep the prompt's blocks for a remote decode
(`PREFILL_TRANSFER_PARAMS`, what vllm-router sends); a producer that hands out a reference
(NixlConnector) answers it at the top level of its answer, and `KVHandoff` carries it to
one decode instance, which pulls the blocks. An instance whose connector hands out none (a
shared store, or none at all) ignores the request's field: the decode finds the KV in the
store or computes it, as before.

The rules (docs/VLLM_ROUTER.md):
- A reference goes to decode instances only, never to a prefill instance decoding.
- A consumer releases a reference once it tried to pull it, so a decode attempt that
  reached an instance spends it; only an attempt that could not even connect leaves it
  for the next decode. Any later attempt, and every migration's continuation, carries
  none: that instance computes the prompt (token-exact either way).
- A client's own `kv_transfer_params` is never forwarded as it is: a reference
  (`do_remote_prefill: true`) stands in for the proxy's prefill (none is made) and goes to
  the first decode like the proxy's own; anything else is dropped.
"""

from __future__ import annotations

from typing import Any

from kvrecover.kv_transfer.p2p.params import parse_reference, wants_remote_prefill

# vllm-router's prefill request field: keep the prompt for a remote decode.
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
FIELD = "kv_transfer_params"


class KVHandoff:
    """One request's reference to a prefill's KV, on its way to one decode instance.
    Built by `ProxiedRequest` from the client's body (`of`), filled by its prefill
    (`take_prefill_answer`) and read by each decode attempt (`for_attempt`)."""

    def __init__(self, reference: dict[str, Any] | None, from_client: bool) -> None:
        self.reference = reference
        self.from_client = from_client

    @classmethod
    def of(cls, body: dict[str, Any]) -> tuple[KVHandoff, dict[str, Any]]:
        """The handoff a client's body asks for, and the body without its field."""
        if FIELD not in body:
            return cls(None, False), body
        rest = {key: value for key, value in body.items() if key != FIELD}
        params = body[FIELD]
        if wants_remote_prefill(params):
            return cls(dict(params), True), rest
        return cls(None, False), rest

    def take_prefill_answer(self, answer: Any) -> None:
        """Keep the reference a prefill answered (its top-level `kv_transfer_params`); an
        answer without one, or with one a decode would refuse, leaves none."""
        params = answer.get(FIELD) if isinstance(answer, dict) else None
        if not isinstance(params, dict) or not wants_remote_prefill(params):
            return
        try:
            parse_reference(params)
        except ValueError:
            return
        self.reference = dict(params)

    def for_attempt(self, body: dict[str, Any], role: str) -> dict[str, Any]:
        """`body` as sent to an instance of `role`: with the reference for a decode."""
        if self.reference is None or role != "decode":
            return body
        return {**body, FIELD: self.reference}

    def attempt_failed(self, role: str, connect_failed: bool) -> None:
        """A decode attempt failed: the reference is spent unless it never arrived."""
        if role == "decode" and not connect_failed:
            self.reference = None

    def drop(self) -> None:
        """Send no reference from now on (another choice of the request pulls it)."""
        self.reference = None
