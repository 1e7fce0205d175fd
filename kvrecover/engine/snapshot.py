"""What the engine shows of itself between steps: `Engine.snapshot()` (and `LLM.snapshot()`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrecover.engine.scheduler import Scheduler
    from kvrecover.engine.stats import EngineStats


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters, queues and KV cache use at one moment (what `/metrics`
    shows). Taken between steps, on the thread that steps the engine."""

    stats: dict[str, int]  # `LLM.stats`: cumulative counters
    num_running: int  # requests scheduled to run
    num_waiting: int  # requests waiting to be scheduled (or for their KV to arrive)
    kv_cache_usage: float  # fraction of usable KV blocks in use, 0.0 to 1.0

    @classmethod
    def of(cls, scheduler: Scheduler, stats: EngineStats) -> EngineSnapshot:
        """The snapshot of an engine's scheduler (its queues and block pool) and counters."""
        pool = scheduler.kv_manager.pool
        usable = pool.num_usable_blocks
        in_use = usable - pool.num_free_blocks
        return cls(stats.snapshot(), len(scheduler.running), len(scheduler.waiting),
                   in_use / usable if usable else 0.0)
