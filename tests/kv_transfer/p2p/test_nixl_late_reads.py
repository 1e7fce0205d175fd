"""A NIXL READ given up at its deadline may still complete later: not one of its bytes
may reach the consumer's KV cache (the blocks were recomputed, or freed and handed to
another request). The consumer's agent is wrapped so that its READs hang: not posted
until the test posts them, long after the pull was declared failed, and waits until
they are DONE (the consumer's releases are held back meanwhile: a producer drives its
agent only while a pull may read it). Pulled directly and as a TieredConnector's first tier, sync and async."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import require_nixl
from test_nixl_connector import (  # noqa: F401 - kill_producers: an autouse fixture
    PROMPTS,
    Producer,
    kill_producers,
    no_connector,
    with_references,
)

from kvrecover import LLM, KVTransferConfig
from kvrecover.kv_transfer.p2p import consumer, nixl_connector
from kvrecover.kv_transfer.p2p.nixl_connector import NixlConnector
from kvrecover.kv_transfer.p2p.pull_tier import PullTier
from kvrecover.kv_transfer.p2p.side_channel import call
from kvrecover.kv_transfer.stores.reader_threads import ReaderThreads, StoreRead

require_nixl()

SENTINEL = 0xA5  # what the cache holds once the given-up blocks belong to someone else


class HungReads:
    """A NIXL agent whose READs hang: `transfer` posts nothing and reports "PROC", so does
    `check_xfer_state`, and `release_xfer_handle` refuses (as NIXL does for a transfer it
    cannot cancel) until `complete_late` posts them for real. With `until`, a READ is
    posted at once but reported "PROC" until that event is set."""

    def __init__(self, agent: Any, until: threading.Event | None = None) -> None:
        self.agent = agent
        self.until = until
        self.hung: list[Any] = []
        self.posted = until is not None and until.is_set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)

    def _is_hung(self, handle: Any) -> bool:
        if self.until is not None and self.until.is_set():
            self.posted = True
        return not self.posted and any(handle is h for h in self.hung)

    def transfer(self, handle: Any) -> str:
        self.hung.append(handle)
        if self.until is not None:
            self.agent.transfer(handle)
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        return "PROC" if self._is_hung(handle) else self.agent.check_xfer_state(handle)

    def release_xfer_handle(self, handle: Any) -> None:
        if self._is_hung(handle):
            raise RuntimeError("the transfer is in flight and cannot be cancelled")
        self.agent.release_xfer_handle(handle)

    def complete_late(self) -> list[str]:
        """Post every hung READ and wait (10 s at most) until each ended; their states."""
        states = [self.agent.transfer(handle) for handle in self.hung]
        self.posted = True
        give_up = time.monotonic() + 10
        while any(s not in ("DONE", "ERR") for s in states) and time.monotonic() < give_up:
            time.sleep(0.001)
            states = [self.agent.check_xfer_state(handle) for handle in self.hung]
        return states


@dataclass
class Hung:
    """The wrapped agents and the connectors (as they register), and the consumer's
    releases held back (host, port, message)."""

    agents: list[HungReads] = field(default_factory=list)
    connectors: list[NixlConnector] = field(default_factory=list)
    releases: list[tuple[str, int, dict]] = field(default_factory=list)
    until: threading.Event | None = None  # see HungReads

    def release_now(self) -> None:
        for host, port, message in self.releases:
            call(host, port, message, timeout_s=5.0)


@pytest.fixture
def hung(monkeypatch) -> Hung:
    """Every NIXL agent of this process hangs its READs; releases wait for the test."""
    state = Hung()
    agents, connectors = state.agents, state.connectors
    make_agent = nixl_connector._nixl_agent
    register = NixlConnector.register_kv_caches

    def hung_agent(name: str, gpu: bool = False) -> HungReads:
        agents.append(HungReads(make_agent(name, gpu), state.until))
        return agents[-1]

    def registered(self: NixlConnector, kv_caches: list[torch.Tensor]) -> None:
        connectors.append(self)
        register(self, kv_caches)

    def held_back(host: str, port: int, message: dict, timeout_s: float = 5.0) -> dict:
        if message.get("op") == "release":
            state.releases.append((host, port, message))
            return {"ok": True}
        return call(host, port, message, timeout_s=timeout_s)

    monkeypatch.setattr(nixl_connector, "_nixl_agent", hung_agent)
    monkeypatch.setattr(NixlConnector, "register_kv_caches", registered)
    monkeypatch.setattr(consumer, "call", held_back)
    return state


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tiered", [False, True], ids=["nixl", "tier0"])
def test_a_read_given_up_that_completes_late_writes_nothing(tiny_llama, hung, tmp_path,
                                                            async_load, tiered):
    producer = Producer(tiny_llama)  # its own process: its agent is not wrapped
    nixl = {"load_timeout_s": 0.5}
    if tiered:
        (tmp_path / "store").mkdir()  # empty: what the pull lost is recomputed
        transfer = KVTransferConfig("TieredConnector", "kv_consumer", {
            "async_load": async_load, "connectors": [
                {"kv_connector": "NixlConnector", "kv_connector_extra_config": nixl},
                {"kv_connector": "SharedStorageConnector",
                 "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "store")}}]})
    else:
        transfer = KVTransferConfig("NixlConnector", "kv_consumer",
                                    {**nixl, "async_load": async_load})
    llm = LLM(str(tiny_llama), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=transfer)
    params = with_references(producer.references)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == no_connector(tiny_llama)
    assert llm.stats.get("kv_nixl_pulled_blocks", 0) == 0
    [agent] = hung.agents
    [connector] = hung.connectors
    assert agent.hung  # the pulls were given up with their READs in flight
    # The given-up blocks now hold another request's KV; the READs land only now.
    caches = connector.consumer.caches
    for cache in caches:
        cache.view(torch.uint8).fill_(SENTINEL)
    assert set(agent.complete_late()) == {"DONE"}
    assert all(bool((cache.view(torch.uint8) == SENTINEL).all()) for cache in caches)
    # Their staging buffers go back into use once NIXL reports the READs ended.
    staging = connector.consumer.reader.staging
    assert staging is not None and staging.num_quarantined() == 0
    llm.close()
    hung.release_now()
    time.sleep(1.0)  # a step of the producer's reports them released
    assert producer.finish() == 0


def test_a_tier_load_given_up_gets_no_pulled_block_copied_after(tiny_llama, hung, tmp_path,
                                                                monkeypatch):
    """The P2P tier pulls on its load's reader thread; the load may be given up (its
    blocks recomputed) while the pull still runs: a READ that completes after that,
    verified or not, is not copied into the cache (the load's fence)."""
    hung.until = threading.Event()  # the READ completes as soon as its load is given up
    abandon = ReaderThreads.abandon

    def abandoned(self: ReaderThreads, task: StoreRead) -> None:
        abandon(self, task)  # the load's fence is set when this returns
        assert hung.until is not None
        hung.until.set()

    pull = PullTier.pull

    def late_pull(self: PullTier, *args: Any) -> tuple[set[int], set[int]]:
        time.sleep(1.0)  # the pull's own deadline ends a second after its load's
        return pull(self, *args)

    monkeypatch.setattr(ReaderThreads, "abandon", abandoned)
    monkeypatch.setattr(PullTier, "pull", late_pull)
    producer = Producer(tiny_llama)
    (tmp_path / "store").mkdir()
    transfer = KVTransferConfig("TieredConnector", "kv_consumer", {
        "load_timeout_s": 1.0, "connectors": [
            {"kv_connector": "NixlConnector",
             "kv_connector_extra_config": {"load_timeout_s": 10.0}},
            {"kv_connector": "SharedStorageConnector",
             "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "store")}}]})
    llm = LLM(str(tiny_llama), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=transfer)
    params = with_references(producer.references)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == no_connector(tiny_llama)
    [agent] = hung.agents
    give_up = time.monotonic() + 10
    # The abandoned pulls post their READs and finish on their reader threads, maybe after
    # the recomputed requests have ended (the pull starts a second late).
    while (not agent.hung or any(t.name.startswith("kv-load-") for t in threading.enumerate())) \
            and time.monotonic() < give_up:
        time.sleep(0.01)
    assert agent.hung and agent.posted  # READs that completed after their load was given up
    stats = llm.stats
    assert stats.get("kv_nixl_pulled_blocks", 0) == stats.get("kv_tier0_loaded_blocks", 0) == 0
    llm.close()
    hung.release_now()
    time.sleep(1.0)  # a step of the producer's reports them released
    assert producer.finish() == 0
