"""What rank 0 and the other ranks say to each other over their control channels.

Each step is one message: the `SchedulerOutput` pickled once, the same bytes written
to every rank's channel (a Unix socket pair per rank, `rank_process.RankChannel`).
Each rank answers with one `RankReport`: its worker connector's part of the step's
`ModelRunnerOutput`. These are the engine's own messages between its own processes
(never stored KV, which is never unpickled: `kv_transfer/stores/block_store.py`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from kvrecover.step_messages import ModelRunnerOutput


@dataclass(frozen=True)
class Message:
    """One control message: `kind` ("start", "allocate", "step", "report", "failed",
    "shutdown", ...) and its body."""

    kind: str
    body: Any = None


def pack(kind: str, body: Any = None) -> bytes:
    """The bytes of one message (pickled once, sent to every rank as they are)."""
    return pickle.dumps(Message(kind, body), protocol=pickle.HIGHEST_PROTOCOL)


def unpack(payload: bytes) -> Message:
    """The message `pack` made."""
    message = pickle.loads(payload)
    if not isinstance(message, Message):
        raise ValueError(f"not a control message: {type(message).__name__}")
    return message


@dataclass
class RankReport:
    """A rank's KV-transfer events of one step (its `ModelRunnerOutput` minus the
    sampled tokens, which only rank 0 has)."""

    invalid_block_ids: set[int] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    kv_save_failed_blocks: int = 0
    kv_load_report_failed: bool = False
    kv_connector_errors: int = 0
    kv_connector_stats: dict[str, int] = field(default_factory=dict)
    failed_requests: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, output: ModelRunnerOutput) -> RankReport:
        """The report of a rank's step output."""
        return cls(output.invalid_block_ids, output.finished_recving, output.finished_sending,
                   output.kv_save_failed_blocks, output.kv_load_report_failed,
                   output.kv_connector_errors, output.kv_connector_stats,
                   output.failed_requests)
