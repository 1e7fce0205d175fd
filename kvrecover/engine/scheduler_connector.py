"""The scheduler's guarded view of the scheduler-role KV connector.

A connector is someone else's code talking to someone else's store: every call
is contained and every answer validated here, so a connector bug never escapes
`generate()`. A call that raises, or an answer that breaks the contract, raises
`ConnectorError`, which the scheduler treats as a KV failure of the request
concerned (handled by the failure policy). Each kind of failure is logged once.

The connector never sees the engine's mutable `Request`: each call gets a fresh
read-only `KVRequestView` (`request_view`), the fields the contract promises.

Claims from `get_num_new_matched_tokens` are validated: a count that is not an
int or is negative is a miss; a count is capped so at least the last prompt
token is computed here and rounded down to whole blocks, so what the connector
claimed but will not load is computed locally.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvrecover.engine.request import Request
from kvrecover.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from kvrecover.kv_transfer.errors import ConnectorErrorLog, checked_counters
from kvrecover.kv_transfer.request_view import KVRequestView

if TYPE_CHECKING:
    from kvrecover.step_messages import SchedulerOutput

logger = logging.getLogger(__name__)


def request_view(request: Request) -> KVRequestView:
    """The read-only view of `request` that the connector contract promises."""
    return KVRequestView(
        request_id=request.request_id,
        prompt_token_ids=tuple(request.prompt_token_ids),
        block_hashes=tuple(request.block_hashes),
        num_computed_tokens=request.num_computed_tokens,
        sampling_params=request.sampling_params,
        block_tables=tuple(tuple(table) for table in request.block_tables),
    )


class ConnectorError(Exception):
    """The connector raised or answered outside its contract; `kind` names the call."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class SchedulerConnector:
    """Calls the scheduler-role connector; contains its exceptions, validates its claims."""

    def __init__(self, connector: KVConnectorBase, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        self.errors = ConnectorErrorLog(logger)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The validated claim (tokens after `num_computed_tokens`, load asynchronously)."""
        kind = "get_num_new_matched_tokens"
        answer = self._call(kind, self.connector.get_num_new_matched_tokens,
                            request_view(request), num_computed_tokens)
        try:
            num_tokens, load_async = answer
        except (TypeError, ValueError):
            self.errors.report(kind, f"returned {answer!r}, not (num_tokens, load_async); "
                                     "handled as a KV load failure")
            raise ConnectorError(kind, f"returned {answer!r}") from None
        if load_async not in (True, False):
            self.errors.report(kind, f"returned load_async={load_async!r}, not a bool; "
                                     "handled as a KV load failure")
            raise ConnectorError(kind, f"returned load_async={load_async!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            self.errors.report("claim", f"claimed {num_tokens!r} tokens; treated as 0",
                               level=logging.WARNING)
            return 0, False
        # The last prompt token is always computed here (its logits give the next
        # token), and only whole blocks are loaded: the rest is computed.
        limit = max(request.num_prompt_tokens - 1, num_computed_tokens)
        end = min(num_computed_tokens + num_tokens, limit)
        end -= end % self.block_size
        valid = max(0, end - num_computed_tokens)
        if valid != num_tokens:
            self.errors.report(
                "claim", f"claimed {num_tokens} tokens after {num_computed_tokens} for a "
                f"{request.num_prompt_tokens}-token prompt; {valid} accepted (whole blocks, "
                "the last prompt token computed locally)", level=logging.WARNING,
            )
        return valid, bool(load_async) and valid > 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Tell the connector where the request's external tokens go."""
        self._call("update_state_after_alloc", self.connector.update_state_after_alloc,
                   request_view(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata for the worker role."""
        return self._call("build_connector_meta", self.connector.build_connector_meta,
                          scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """Tell the connector a request ended. True: it keeps reading the blocks until
        it reports the request in `finished_sending` (hold them). A failure, or an
        answer that is not a bool, frees them now and affects nobody else."""
        kind = "request_finished"
        try:
            answer = self._call(kind, self.connector.request_finished, request_view(request),
                                block_ids, effect="the request had ended; its blocks are freed")
        except ConnectorError:
            return False
        if answer is None or answer is False:
            return False
        if answer is not True:
            self.errors.report(kind, f"returned {answer!r}, not a bool; the blocks are freed")
            return False
        try:
            params = self._call("kv_transfer_params", self.connector.kv_transfer_params,
                                request_view(request), effect="no reference is handed out")
        except ConnectorError:
            return True
        if params is not None and not isinstance(params, dict):
            self.errors.report("kv_transfer_params", f"returned {type(params).__name__}, not a "
                               "dict; no reference is handed out")
            params = None
        request.kv_transfer_params = params
        return True

    def connector_stats(self) -> dict[str, int]:
        """The connector's own counter increments since the last call ({} on failure)."""
        try:
            return checked_counters(self.connector.get_connector_stats())
        except Exception as error:
            self.errors.report("get_connector_stats", f"failed: {error!r}; its counters are "
                               "not counted", exc_info=True)
            return {}

    def _call(self, kind: str, method, *args,
              effect: str = "handled as a KV load failure of the requests it concerns"):
        try:
            return method(*args)
        except Exception as error:
            self.errors.report(kind, f"raised {error!r}; {effect}", exc_info=True)
            raise ConnectorError(kind, repr(error)) from error
