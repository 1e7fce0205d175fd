"""Memory over many rounds of clients that leave (issue #29): the RSS of a real
`kvrecover serve` process stops growing instead of growing with every round.

What the RSS does, measured (72 leaving clients a round; least-squares slope of 15
rounds): 9.8 MiB a round over rounds 0-15, 3.3 over 15-30, 2.1 over 30-45, 0.8 over
45-60, then 0.15-0.43 from round 60 to 150 (374 -> 635 MiB in all). Not a leak: the
Python objects alive stay the same in number round after round, and the engine alone
plateaus exactly when every KV cache block has been touched once (its pages are mapped
lazily: 48 MiB for the default cache of the tiny model); the rest is allocator and cache
warm-up that levels off. A leak grows by the same amount every round, so the test
compares the slope of the last rounds with that of the early ones (and bounds it), with
a small KV cache so that its first touch is over early.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import psutil
import pytest
from conftest import build_tiny_model
from serving_utils import add_chat_template, long_request, request_bytes, serve, wait_until_idle

pytestmark = pytest.mark.slow  # a separate server process, a minute or so

# 120 rounds, not 60: at 60 the warm-up still adds 0.8-2.3 MiB a round, and a CI run whose
# warm-up came slower (2.9 MiB a round early, 1.5 late) failed the ratio on no leak.
ROUNDS = 120
EARLY_ROUNDS = range(5, 20)  # after the first few rounds, before things level off
LAST_ROUNDS = 15
CLIENTS_PER_ROUND = 24  # each round: this many of each kind of leaving client
TIME_LIMIT_S = 420.0
# Measured: 3-10 MiB a round early, 0.15-0.4 over the last rounds. A leak keeps its
# early slope; a leak of 16 KiB per request is 1.1 MiB a round.
MAX_LAST_TO_EARLY_SLOPE = 0.5
MAX_LAST_SLOPE_BYTES_PER_ROUND = 3 << 19
PATHS = ["/v1/completions", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("soak_model"), seed=3))


def leave_after_sending(port: int, path: str, stream: bool, read_first: bool) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request_bytes(port, path, long_request(path, stream, max_tokens=300)))
        if read_first:
            sock.recv(1)


def one_round(port: int) -> None:
    """CLIENTS_PER_ROUND clients of each kind, all at once: non-streamed, streamed that
    leave at once, streamed that leave after the first bytes; both endpoints."""
    kinds = [(False, False), (True, False), (True, True)]
    threads = [threading.Thread(target=leave_after_sending,
                                args=(port, PATHS[i % 2], stream, read_first))
               for i in range(CLIENTS_PER_ROUND) for stream, read_first in kinds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


def slope(values: list[float]) -> float:
    """Least-squares slope of `values` against their index."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    return covariance / sum((x - mean_x) ** 2 for x in range(n))


def test_rss_levels_off_over_rounds_of_leaving_clients(model_dir, tmp_path):
    process = serve(tmp_path, model_dir, "--num-kv-blocks", "512")
    try:
        process.wait_healthy()
        server = psutil.Process(process.proc.pid)
        rss = []
        started = time.monotonic()
        for _ in range(ROUNDS):
            one_round(process.port)
            wait_until_idle(process.url)
            time.sleep(0.2)  # let the handlers of the last clients finish
            rss.append(server.memory_info().rss)
            assert time.monotonic() - started < TIME_LIMIT_S, f"too slow: RSS {rss}"
        assert httpx.get(f"{process.url}/health", timeout=10).status_code == 200
    finally:
        process.kill()
    mib = [round(r / (1 << 20), 1) for r in rss]
    early = slope([rss[i] for i in EARLY_ROUNDS])
    last = slope(rss[-LAST_ROUNDS:])
    assert last < MAX_LAST_SLOPE_BYTES_PER_ROUND, f"RSS (MiB) per round: {mib}"
    assert last <= MAX_LAST_TO_EARLY_SLOPE * max(early, 0), \
        f"RSS keeps growing ({last / 2**20:.2f} MiB/round late, {early / 2**20:.2f} " \
        f"early): {mib}"
