"""The producer's side channel answering a check that comes before the step holding its
blocks (vllm-router forwards a reference the moment the prefill answers): it waits for
that step; a released reference is refused at once, an unknown one after the wait."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.p2p import producer as p2p_producer
from kvrecover.kv_transfer.p2p.nixl_connector import NixlConnector, NixlMetadata

HANDLE = "cmpl-1@00ff"
BLOCKS, HASHES = [3, 5], ["aa", "bb"]  # one KV cache group: block ids by position


@pytest.fixture
def producer(monkeypatch) -> NixlConnector:
    monkeypatch.setattr(p2p_producer, "UNBOUND_HOLD_WAIT_S", 0.5)
    layout = KVCacheLayout("side-channel-test", torch.float32, 4, 1, 2, 8)
    connector = NixlConnector(KVTransferConfig("NixlConnector", "kv_producer"),
                              KVConnectorRole.WORKER, layout)
    assert connector.producer is not None
    connector.producer.caches = [torch.arange(2 * 8 * 4 * 2 * 8, dtype=torch.float32)
                                 .view(2, 8, 4, 2, 8)]  # no agent: a check reads the cache
    return connector


def check(connector: NixlConnector, handle: str = HANDLE) -> dict:
    slots = [[0, position, block] for position, block in enumerate(BLOCKS)]
    assert connector.producer is not None
    return connector.producer.serve({"op": "check", "handle": handle,
                                     "position": len(BLOCKS) - 1, "blocks": slots,
                                     "last_block_hash": HASHES[-1]})


def bind_later(connector: NixlConnector, delay_s: float) -> threading.Thread:
    def bind() -> None:
        time.sleep(delay_s)
        connector.bind_connector_metadata(NixlMetadata(holds={HANDLE: ((tuple(BLOCKS),), HASHES)}))

    thread = threading.Thread(target=bind)
    thread.start()
    return thread


def test_a_check_before_the_holding_step_waits_for_it(producer):
    binder = bind_later(producer, 0.1)
    answer = check(producer)
    binder.join(timeout=5)
    assert answer["ok"] is True and len(answer["checksums"]) == len(BLOCKS), answer


def test_a_released_reference_is_refused_at_once(producer):
    bind_later(producer, 0).join(timeout=5)
    assert check(producer)["ok"] is True
    assert producer.producer is not None
    assert producer.producer.serve({"op": "release", "handle": HANDLE})["ok"] is True
    start = time.monotonic()
    assert check(producer)["ok"] is False
    assert time.monotonic() - start < 0.25


def test_an_unknown_reference_is_refused_after_the_wait(producer):
    start = time.monotonic()
    answer = check(producer, "cmpl-never@0000")
    assert answer["ok"] is False and "unknown" in answer["reason"]
    assert 0.45 <= time.monotonic() - start < 5
