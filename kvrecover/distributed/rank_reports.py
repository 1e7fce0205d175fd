"""The ranks' KV-transfer reports made one (DESIGN rule 9).

A block is valid only if it is valid on every rank, so the step's invalid blocks are
the union over ranks, and a rank whose connector raised or answered outside the
contract (its `WorkerConnector` turned that into invalid blocks or
`kv_load_report_failed`) fails those blocks for every rank. A load or send is
finished only when every rank reported it finished: until then the engine keeps the
request waiting, and its deadline (`load_timeout_s`) fails a rank that never answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrecover.distributed.messages import RankReport
from kvrecover.step_messages import ModelRunnerOutput


class RankReports:
    """Folds the other ranks' reports into rank 0's step output, step by step."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._recving: dict[str, set[int]] = {}  # request id -> ranks whose load finished
        self._sending: dict[str, set[int]] = {}

    def merge(self, output: ModelRunnerOutput, reports: Sequence[RankReport]) -> None:
        """Make `output` (rank 0's) the group's: `reports[i]` is rank i + 1's."""
        for report in reports:
            output.invalid_block_ids |= report.invalid_block_ids
            output.kv_load_report_failed |= report.kv_load_report_failed
            output.kv_save_failed_blocks += report.kv_save_failed_blocks
            output.kv_connector_errors += report.kv_connector_errors
            for name, count in report.kv_connector_stats.items():
                output.kv_connector_stats[name] = output.kv_connector_stats.get(name, 0) + count
            for request_id, message in report.failed_requests.items():
                output.failed_requests.setdefault(request_id, message)
        output.finished_recving = self._all_ranks(
            self._recving, output.finished_recving, [r.finished_recving for r in reports])
        output.finished_sending = self._all_ranks(
            self._sending, output.finished_sending, [r.finished_sending for r in reports])

    def _all_ranks(self, pending: dict[str, set[int]], first: set[str],
                   others: list[set[str]]) -> set[str]:
        """The requests every rank has now reported (each rank reports a request once)."""
        for rank, finished in enumerate([first, *others]):
            for request_id in finished:
                pending.setdefault(request_id, set()).add(rank)
        done = {request_id for request_id, ranks in pending.items() if len(ranks) == self.size}
        for request_id in done:
            del pending[request_id]
        return done
