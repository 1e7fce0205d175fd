"""Engine counters exposed as `LLM.stats`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class EngineStats:
    """Cumulative counters since the engine started."""

    prompt_tokens_computed: int = 0  # prompt tokens run through the model (recomputes included)
    prompt_tokens_external: int = 0  # prompt tokens loaded by the connector and verified valid
    # Bytes of the cache blocks connectors were asked to load (every KV cache group's;
    # a windowed group's last window and margin only).
    kv_load_bytes: int = 0
    prefix_cache_hit_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    kv_load_failed_blocks: int = 0
    kv_load_recovered_requests: int = 0
    # Tokens a failed load lost that are computed again (not those a retry loads again).
    kv_load_recomputed_tokens: int = 0
    kv_load_failed_requests: int = 0
    kv_save_failed_blocks: int = 0
    kv_connector_errors: int = 0  # connector calls that raised or broke the contract (contained)
    overlapped_steps: int = 0  # decode steps run on the overlapped path (launch_decode)
    # The connector's own counters (e.g. a tiered connector's `kv_tier0_loaded_blocks`).
    connector: dict[str, int] = field(default_factory=dict)

    def add_connector_stats(self, increments: dict[str, int] | None) -> None:
        """Add a connector's counter increments (see `KVConnectorBase.get_connector_stats`)."""
        for name, increment in (increments or {}).items():
            self.connector[name] = self.connector.get(name, 0) + increment

    def snapshot(self) -> dict[str, int]:
        """A plain copy of all counters; a connector counter never hides an engine one."""
        counters = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "connector"}
        return {**self.connector, **counters}
