"""Faults behind vllm-router (the real binary) in front of kvrecover over NIXL: a pull that
fails (the decode recomputes: still a correct 200; policy `fail`: an error, never a 200),
a decode instance killed, the prefill instance killed. What the router itself does in
each case is in docs/VLLM_ROUTER.md."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from conftest import build_tiny_model, require_nixl
from router_helpers import ENGINE as PD_ENGINE
from router_helpers import (
    NO_PREFIX_CACHE,
    PROMPT,
    Router,
    completion,
    consumer,
    producer,
    required_router_binary,
    sdk,
    serve_nixl,
    served_requests,
)
from serving_utils import add_chat_template, metric

pytestmark = pytest.mark.slow  # separate processes

require_nixl()

ENGINE = (*PD_ENGINE, *NO_PREFIX_CACHE)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Instances: prefills `prefill` and `prefill2`; decodes `recompute` and `fail` whose
    every pull fails (the FaultInjectionConnector around NIXL) under those policies; a
    healthy decode `doomed` (killed by a test). Routers: `prefill` in front of each faulty
    decode, `pair` in front of [recompute, doomed], `prefills` both prefills in front of
    `recompute` (the last two health-check every second)."""
    binary = required_router_binary()
    model_dir = add_chat_template(build_tiny_model(tmp_path_factory.mktemp("model"), seed=3))
    logs = tmp_path_factory.mktemp("router_fault_logs")
    instances = serve_nixl(logs, model_dir, ENGINE, {
        "prefill": producer(), "recompute": consumer(faulty=True),
        "fail": consumer("fail", faulty=True), "doomed": consumer(), "prefill2": producer()})
    routers: dict[str, Router] = {}
    try:
        for name, prefills, decodes in (
                ("recompute", ["prefill"], ["recompute"]), ("fail", ["prefill"], ["fail"]),
                ("pair", ["prefill"], ["recompute", "doomed"]),
                ("prefills", ["prefill", "prefill2"], ["recompute"])):
            extra = ("--health-check-interval-secs", "1") if len(prefills + decodes) > 2 else ()
            routers[name] = Router(binary, [instances[p].url for p in prefills],
                                   [instances[d].url for d in decodes],
                                   logs / f"router-{name}.log", *extra)
        for router in routers.values():
            router.wait_healthy()
        yield routers, instances
    finally:
        for router in routers.values():
            router.kill()
        for process in instances.values():
            process.kill()


@pytest.fixture(scope="module")
def want(fleet) -> list[int]:
    """The token ids one instance answers alone (a decode given no reference pulls nothing)."""
    _, instances = fleet
    status, ids, error = completion(instances["doomed"].url, stream=False)
    assert status == 200 and len(ids) == 8, error
    return ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_failed_pull_is_recomputed_behind_the_router(fleet, want, stream):
    routers, instances = fleet
    url = instances["recompute"].url
    failed = metric(url, "kvrecover_kv_load_failed_blocks_total")
    recovered = metric(url, "kvrecover_kv_load_recovered_requests_total")
    assert completion(routers["recompute"].url, stream)[:2] == (200, want)
    assert metric(url, "kvrecover_kv_load_failed_blocks_total") > failed
    assert metric(url, "kvrecover_kv_load_recovered_requests_total") == recovered + 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_policy_fail_is_an_error_never_a_200_behind_the_router(fleet, stream):
    """The router passes the decode's 503 and its body on (streamed too: the decode
    fails before its first byte)."""
    routers, instances = fleet
    failed = metric(instances["fail"].url, "kvrecover_kv_load_failed_requests_total")
    status, _, error = completion(routers["fail"].url, stream)
    assert status == 503, error
    assert json.loads(error)["error"]["type"] == "kv_load_failed"
    assert metric(instances["fail"].url, "kvrecover_kv_load_failed_requests_total") == failed + 1
    with pytest.raises(openai.APIStatusError) as info:
        sdk(routers["fail"].url).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=stream)
    assert info.value.status_code == 503


def kill_mid_stream(url: str, decode) -> None:
    """Stream long completions through the router at `url` until one is answered by
    `decode` (the answer's id names it: the router's X-Request-Id); kill `decode` after
    its first chunk. The router then cuts the client's stream: a broken chunked body,
    never a clean end (`[DONE]`) the client could take for a whole answer."""
    port = decode.url.rsplit(":", 1)[1]
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
               "stream": True, "ignore_eos": True}
    for _ in range(2):  # round robin over two decodes
        with httpx.stream("POST", f"{url}/v1/completions", json=request,
                          timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            if f"decode_addr_127.0.0.1:{port}_" not in next(lines):
                assert "data: [DONE]" in list(lines)
                continue
            decode.kill()
            rest: list[str] = []
            with pytest.raises(httpx.RemoteProtocolError):
                rest.extend(lines)
            assert "data: [DONE]" not in rest
            return
    pytest.fail("no stream reached the decode to kill")


def test_a_killed_decode_fails_its_share_until_the_routers_health_check_drops_it(
        fleet, want):
    """A decode killed mid-stream: the router cuts the client's stream. After it, the
    router neither retries nor fails over the decode it cannot reach: round robin sends it
    its share, each a 500, until its health check (every second here) marks it unhealthy;
    from then on the survivor answers every request, correctly."""
    routers, instances = fleet
    kill_mid_stream(routers["pair"].url, instances["doomed"])
    statuses = until_six_answers_in_a_row(routers["pair"].url, want, "Decode request failed")
    assert 500 in statuses, "the router failed over: update docs/VLLM_ROUTER.md"
    assert httpx.get(f"{routers['pair'].url}/health", timeout=10).status_code == 503


def until_six_answers_in_a_row(url: str, want: list[int], failure: str) -> list[int]:
    """Statuses of completions sent to `url` (alternately whole and streamed) until six in
    a row are 200s (bounded): each 200 answers `want`, each other a 500 naming `failure`."""
    statuses: list[int] = []
    deadline = time.monotonic() + 30
    while statuses[-6:] != [200] * 6:
        assert time.monotonic() < deadline and len(statuses) < 200, statuses
        status, ids, error = completion(url, stream=len(statuses) % 2 == 1)
        statuses.append(status)
        if status == 200:
            assert ids == want
        else:
            assert status == 500 and failure in error, (status, error)
            time.sleep(0.1)
    return statuses


def test_a_killed_prefill_is_a_500_until_the_routers_health_check_drops_it(fleet, want):
    """Runs last: it kills the prefill instance every router uses. With no other prefill
    every request is a 500 and the decode gets none; with another, round robin still
    sends the dead one its share (500s, no fail-over) until the health check drops it."""
    routers, instances = fleet
    requests = served_requests(instances["recompute"].url)
    instances["prefill"].kill()
    for stream in (False, True):
        status, _, error = completion(routers["recompute"].url, stream)
        assert status == 500 and "Prefill request" in error, (status, error)
    assert served_requests(instances["recompute"].url) == requests
    statuses = until_six_answers_in_a_row(routers["prefills"].url, want, "Prefill request")
    assert 500 in statuses, "the router failed over: update docs/VLLM_ROUTER.md"
    assert httpx.get(f"{instances['recompute'].url}/health", timeout=10).status_code == 200
