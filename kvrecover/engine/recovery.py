"""KV load failure recovery: turn reported invalid blocks into rolled-back requests.

Given the block ids whose load failed, every request that counts such a block
among its computed tokens is cut back to the start of its first invalid block
(policy `recompute`), or marked failed (policy `fail`). Invalid blocks leave the
prefix cache; shared ones are swapped for private copies (KVCacheManager).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kvrecover.engine.kv_cache_manager import KVCacheManager
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.engine.stats import EngineStats
from kvrecover.kv_layout import blocks_needed

logger = logging.getLogger(__name__)


@dataclass
class RecoveryAction:
    """What recovery did to one request."""

    request_id: str
    first_invalid_block: int
    num_invalid_blocks: int
    num_tokens_lost: int
    failed: bool  # policy `fail`: the request must end with an error


class KVLoadRecovery:
    """Applies the failure policy to the requests that hold invalid blocks."""

    def __init__(
        self, kv_manager: KVCacheManager, policy: str, retry_limit: int, stats: EngineStats
    ) -> None:
        self.kv_manager = kv_manager
        self.policy = policy
        self.retry_limit = retry_limit
        self.stats = stats

    def apply(self, invalid_block_ids: set[int], requests: Iterable[Request]) -> dict[str, RecoveryAction]:
        """Roll back (or fail) each request holding one of `invalid_block_ids`."""
        if not invalid_block_ids:
            return {}
        self.stats.kv_load_failed_blocks += len(invalid_block_ids)
        pool = self.kv_manager.pool
        for block_id in invalid_block_ids:
            if 0 < block_id < len(pool.blocks):
                pool.uncache(pool.blocks[block_id])
        actions = {}
        for request in requests:
            action = self._apply_one(request, invalid_block_ids)
            if action is not None:
                actions[request.request_id] = action
        return actions

    def _apply_one(self, request: Request, invalid: set[int]) -> RecoveryAction | None:
        block_size = self.kv_manager.block_size
        computed_blocks = request.block_ids[: blocks_needed(request.num_computed_tokens, block_size)]
        bad_positions = [i for i, block_id in enumerate(computed_blocks) if block_id in invalid]
        if not bad_positions:
            return None
        first_bad = bad_positions[0]
        cut = first_bad * block_size
        lost = request.num_computed_tokens - cut
        self.kv_manager.invalidate_from(request, first_bad, invalid)
        request.num_computed_tokens = cut
        request.num_kv_load_failures += 1
        failed = self.policy == "fail"
        if failed:
            self.stats.kv_load_failed_requests += 1
            request.error = f"KV load failed for {len(bad_positions)} block(s)"
            request.error_type = "kv_load_failed"
            logger.warning(
                "request %s: KV load failed for %d block(s); policy 'fail' ends it with an error",
                request.request_id, len(bad_positions),
            )
        else:
            self.stats.kv_load_recovered_requests += 1
            self.stats.kv_load_recomputed_tokens += lost
            if request.status is RequestStatus.WAITING and request.num_kv_load_failures <= self.retry_limit:
                request.connector_consulted = False  # may ask the connector again, boundedly
            logger.info(
                "request %s: KV load failed for %d block(s); rolled back to token %d, "
                "%d token(s) to reload or recompute",
                request.request_id, len(bad_positions), cut, lost,
            )
        return RecoveryAction(request.request_id, first_bad, len(bad_positions), lost, failed)
