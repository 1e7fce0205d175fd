"""The producer's side channel answering a check that comes before the step holding its
blocks (vllm-router forwards a reference the moment the prefill answers): it waits for
that step; a released reference is refused at once, an unknown one after the wait. A
call is bounded in all: a peer that trickles its answer or a name lookup that hangs
costs no more than the call's timeout."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.p2p import producer as p2p_producer
from kvrecover.kv_transfer.p2p.nixl_connector import NixlConnector, NixlMetadata
from kvrecover.kv_transfer.p2p.side_channel import SideChannelError, call

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


def trickling_server(stop: threading.Event) -> tuple[socket.socket, threading.Thread]:
    """A peer that takes the connection and sends its answer a byte every 0.05 s,
    never ending the line (until `stop`, at most 5 s)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            end = time.monotonic() + 5
            while not stop.is_set() and time.monotonic() < end:
                try:
                    connection.sendall(b" ")
                except OSError:
                    return
                time.sleep(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_a_peer_that_trickles_its_answer_costs_a_call_no_more_than_its_timeout():
    stop = threading.Event()
    server, thread = trickling_server(stop)
    started = time.monotonic()
    try:
        with pytest.raises(SideChannelError):
            call("127.0.0.1", server.getsockname()[1], {"op": "check"}, timeout_s=0.5)
        took = time.monotonic() - started
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
    assert took < 1.5, f"a call of timeout 0.5 s took {took:.2f} s"


def test_a_name_lookup_that_hangs_costs_a_call_no_more_than_its_timeout(monkeypatch):
    def hanging_lookup(*args, **kwargs):
        time.sleep(3)
        raise socket.gaierror("no answer")

    monkeypatch.setattr(socket, "getaddrinfo", hanging_lookup)
    started = time.monotonic()
    with pytest.raises(SideChannelError, match="looking up"):
        call("prefill.example", 5600, {"op": "check"}, timeout_s=0.3)
    took = time.monotonic() - started
    assert took < 1.0, f"a call of timeout 0.3 s took {took:.2f} s"


def test_an_address_is_not_looked_up_and_a_bad_name_fails_fast(monkeypatch):
    looked_up: list[str] = []
    real_lookup = socket.getaddrinfo

    def counting_lookup(host, *args, **kwargs):
        looked_up.append(host)
        return real_lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counting_lookup)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.close()  # nothing listens there now: refused at once
    with pytest.raises(SideChannelError):
        call("127.0.0.1", port, {"op": "check"}, timeout_s=2)
    assert "127.0.0.1" not in looked_up
    with pytest.raises(SideChannelError):
        call("localhost", port, {"op": "check"}, timeout_s=2)
    assert looked_up == ["localhost"]
