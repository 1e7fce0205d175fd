"""Prometheus metrics of one `kvrecover serve` instance.

The engine's counters (`LLM.stats`), queue sizes and KV cache use are read from
`LLM.snapshot()` at scrape time; latencies are observed by the HTTP handlers. Each server
has its own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from kvrecover.engine import EngineSnapshot

PREFIX = "kvrecover"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The metrics registry of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.num_running = Gauge(f"{PREFIX}_num_requests_running",
                                 "requests the engine is running", registry=registry)
        self.num_waiting = Gauge(f"{PREFIX}_num_requests_waiting",
                                 "requests waiting to be scheduled", registry=registry)
        self.kv_cache_usage = Gauge(f"{PREFIX}_kv_cache_usage_ratio",
                                    "fraction of KV cache blocks in use", registry=registry)
        self.engine_alive = Gauge(f"{PREFIX}_engine_alive", "1 while the engine loop runs",
                                  registry=registry)
        self.engine_counters = EngineCounters()
        registry.register(self.engine_counters)
        self.requests = Counter(f"{PREFIX}_requests", "finished HTTP generation requests",
                                ["endpoint", "outcome"], registry=registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "mean time between output tokens of a request",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "arrival to last token", buckets=LATENCY_BUCKETS, registry=registry)

    def observe_request(self, endpoint: str, outcome: str, ttft: float | None,
                        e2e: float, num_tokens: int) -> None:
        """Record one finished request (its outcome: ok, error, aborted)."""
        self.requests.labels(endpoint, outcome).inc()
        if ttft is None:
            return
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if num_tokens > 1:
            self.tpot.observe((e2e - ttft) / (num_tokens - 1))

    def render(self, snapshot: EngineSnapshot, alive: bool) -> bytes:
        """The text exposition format, with the engine's state from `snapshot` and
        whether its loop runs (`alive`)."""
        self.num_running.set(snapshot.num_running)
        self.num_waiting.set(snapshot.num_waiting)
        self.kv_cache_usage.set(snapshot.kv_cache_usage)
        self.engine_alive.set(1 if alive else 0)
        self.engine_counters.stats = snapshot.stats
        return generate_latest(self.registry)


class EngineCounters:
    """Exports each `LLM.stats` counter as `kvrecover_<name>_total` (a Prometheus
    counter), from the last engine snapshot."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {}

    def collect(self):
        for name, value in self.stats.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", f"engine counter {name} (LLM.stats)",
                                      value=value)
