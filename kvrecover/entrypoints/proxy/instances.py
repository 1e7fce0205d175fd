"""The instances behind `kvrecover proxy`: their health, their load, the proxy's metrics.

A background task asks every instance's `/health` each interval and marks it up
or down; a request that cannot even connect marks its instance down at once, so
the next request skips it until a health check brings it back. A healthy
instance's `/health` also says its `vocab_size` and `max_model_len`, which the
proxy checks its answers against (`checks.py`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvrecover.entrypoints.openai.shapes import ShapeError, load_json

logger = logging.getLogger(__name__)


@dataclass
class Instance:
    """One `kvrecover serve` behind the proxy."""

    url: str
    role: str  # "prefill" or "decode"
    index: int
    up: bool = True
    in_flight: int = 0  # requests the proxy has open on it
    vocab_size: int | None = None  # from its /health: token ids are below this
    max_model_len: int | None = None  # from its /health: prompt + output tokens at most


class ProxyMetrics:
    """Per-instance counters of the proxy."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["instance", "role"]
        self.requests = Counter("kvrecover_proxy_requests", "requests sent to an instance",
                                labels, registry=self.registry)
        self.retries = Counter("kvrecover_proxy_retries",
                               "prefill attempts that failed and were retried elsewhere",
                               labels, registry=self.registry)
        self.failovers = Counter("kvrecover_proxy_failovers",
                                 "decode attempts that failed before any byte reached the "
                                 "client and moved to another instance", labels,
                                 registry=self.registry)
        self.migrations = Counter("kvrecover_proxy_migrations",
                                  "requests continued elsewhere after the instance died "
                                  "mid-stream", labels, registry=self.registry)
        self.up = Gauge("kvrecover_proxy_instance_up", "1 while the instance is healthy",
                        labels, registry=self.registry)
        self.unavailable = Counter("kvrecover_proxy_unavailable",
                                   "requests answered 503 because no instance could serve "
                                   "them", registry=self.registry)

    def count(self, counter: Counter, instance: Instance) -> None:
        """Add one to `counter` for `instance`."""
        counter.labels(instance.url, instance.role).inc()


class InstancePool:
    """The prefill and decode instances, with their health."""

    def __init__(self, prefill: list[str], decode: list[str], metrics: ProxyMetrics) -> None:
        if not prefill and not decode:
            raise ValueError("the proxy needs at least one --prefill or --decode URL")
        self.prefill = [Instance(u.rstrip("/"), "prefill", i) for i, u in enumerate(prefill)]
        self.decode = [Instance(u.rstrip("/"), "decode", i) for i, u in enumerate(decode)]
        self.metrics = metrics
        for instance in self.all:
            metrics.up.labels(instance.url, instance.role).set(1)

    @property
    def all(self) -> list[Instance]:
        return self.prefill + self.decode

    def prefill_candidates(self) -> list[Instance]:
        """Healthy prefill instances, least loaded first."""
        return _least_loaded(self.prefill)

    def decode_candidates(self) -> list[Instance]:
        """Healthy decode instances least loaded first, then prefill instances (which
        can decode too)."""
        return _least_loaded(self.decode) + _least_loaded(self.prefill)

    def mark(self, instance: Instance, up: bool) -> None:
        """Record an instance's health."""
        if instance.up != up:
            logger.log(logging.INFO if up else logging.WARNING, "%s instance %s is %s",
                       instance.role, instance.url, "up" if up else "down")
        instance.up = up
        self.metrics.up.labels(instance.url, instance.role).set(1 if up else 0)

    async def check_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        """Ask every instance's /health once."""
        async def check(instance: Instance) -> None:
            try:
                response = await client.get(f"{instance.url}/health", timeout=timeout)
                if response.status_code == 200:
                    _learn_limits(instance, response.content)
                self.mark(instance, response.status_code == 200)
            except httpx.HTTPError:
                self.mark(instance, False)

        await asyncio.gather(*(check(instance) for instance in self.all))

    async def health_loop(self, client: httpx.AsyncClient, interval: float) -> None:
        """Check every `interval` seconds until cancelled."""
        while True:
            await self.check_all(client, timeout=min(interval, 5.0))
            await asyncio.sleep(interval)


def _learn_limits(instance: Instance, content: bytes) -> None:
    """Take `vocab_size` and `max_model_len` from a /health answer (kept when absent)."""
    try:
        report = load_json(content)
    except ShapeError:
        return
    if not isinstance(report, dict):
        return
    for name in ("vocab_size", "max_model_len"):
        value = report.get(name)
        if type(value) is int and value > 0:
            setattr(instance, name, value)


def _least_loaded(instances: list[Instance]) -> list[Instance]:
    return sorted((i for i in instances if i.up), key=lambda i: (i.in_flight, i.index))
