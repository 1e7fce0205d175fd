"""What a scheduler-role connector sees of a request: a read-only snapshot.

The engine's `Request` is mutable and engine-private; a connector gets this view
instead (built by `engine/scheduler_connector.py` at each call), holding only what
the contract promises. It is a snapshot: `num_computed_tokens` is the value at the
call, and a connector may keep the view across steps (the prompt and its block
hashes never change).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrecover.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class KVRequestView:
    """A request as a connector sees it (`KVConnectorBase`'s scheduler-role methods)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    # Chain hash (`kv_layout.hash_block_tokens`) of every full block of the prompt, at
    # least: the keys of stored KV.
    block_hashes: tuple[bytes, ...]
    num_computed_tokens: int  # at the time of the call (see each method)
    sampling_params: SamplingParams
    # Every KV cache group's block table at the call (`kv_groups.py`), group 0's first:
    # what a connector with `supports_kv_groups` reads. A windowed group's table holds
    # the null block (`kv_layout.NULL_BLOCK_ID`) where it keeps no block.
    block_tables: tuple[tuple[int, ...], ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
