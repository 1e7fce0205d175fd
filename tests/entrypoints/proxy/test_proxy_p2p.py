"""`kvrecover proxy` speaking vLLM's P/D protocol to NIXL instances: the prefill request
carries `kv_transfer_params` (do_remote_decode), the prefill's answer's reference goes with
the request to a decode instance, which pulls the blocks. Through the proxy the client
gets what one instance answers alone (token ids), every answer pulled; and the fault
matrix of docs/VLLM_ROUTER.md, where the proxy fails over and migrates instead of
passing errors on."""

from __future__ import annotations

import httpx
import pytest
from conftest import build_tiny_model, require_nixl
from router_helpers import ENGINE as PD_ENGINE
from router_helpers import (
    NO_PREFIX_CACHE,
    PROMPT,
    completion,
    consumer,
    nixl_transfer,
    producer,
    serve_nixl,
    served_requests,
    streamed_token_ids,
)
from serving_utils import Process, add_chat_template, free_port, metric, serve
from test_proxy import read_killing_the_decode

pytestmark = pytest.mark.slow  # separate processes

require_nixl()

ENGINE = (*PD_ENGINE, *NO_PREFIX_CACHE)
PULLED = "kvrecover_kv_nixl_pulled_blocks_total"
FAILED = "kvrecover_kv_load_failed_blocks_total"


class Fleet:
    """Instances: prefills `prefill` and `prefill2`; healthy decodes `d0`, `d1`; decodes `recompute` and `fail`
    whose every pull fails (under those policies). Proxies, started on demand."""

    def __init__(self, tmp, model_dir) -> None:
        self.tmp, self.model_dir = tmp, model_dir
        self.transfers = {
            "prefill": producer(), "prefill2": producer(), "d0": consumer(), "d1": consumer(),
            "recompute": consumer(faulty=True), "fail": consumer("fail", faulty=True)}
        self.instances = serve_nixl(tmp, model_dir, ENGINE, self.transfers)
        self.processes: list[Process] = list(self.instances.values())

    @property
    def decode(self) -> list[Process]:
        """The decode instances (what `read_killing_the_decode` looks through)."""
        return [p for name, p in self.instances.items() if not name.startswith("prefill")]

    def __getitem__(self, name: str) -> Process:
        return self.instances[name]

    def proxy(self, decodes: list[str], *extra: str,
              prefills: tuple[str, ...] = ("prefill",)) -> Process:
        """A proxy in front of `prefills` and `decodes` (health checks every 600 s: it
        learns of a dead instance by trying it)."""
        port = free_port()
        argv = ["proxy", "--prefill", *[self[name].url for name in prefills],
                "--decode", *[self[name].url for name in decodes], "--port", str(port),
                "--health-check-interval", "600", *extra]
        process = Process(argv, port, self.tmp / f"proxy-{port}.log")
        self.processes.append(process)
        return process.wait_healthy()

    def restart(self, process: Process) -> None:
        """A new instance in place of `process` (killed), on its port, as configured."""
        name = next(n for n, p in self.instances.items() if p is process)
        restarted = serve(self.tmp, self.model_dir, *ENGINE, "--kv-transfer-config",
                          nixl_transfer(**self.transfers[name]), name=f"{name}-restarted",
                          port=process.port)
        self.processes.append(restarted)
        self.instances[name] = restarted.wait_healthy()

    def close(self) -> None:
        for process in self.processes:
            process.kill()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model_dir = add_chat_template(build_tiny_model(tmp_path_factory.mktemp("model"), seed=3))
    fleet = Fleet(tmp_path_factory.mktemp("proxy_p2p_logs"), model_dir)
    try:
        yield fleet
    finally:
        fleet.close()


def pulls(fleet: Fleet, *names: str) -> tuple[float, float]:
    """(blocks pulled, pulled blocks that failed) on the decodes `names`."""
    return (sum(metric(fleet[n].url, PULLED) for n in names),
            sum(metric(fleet[n].url, FAILED) for n in names))


@pytest.fixture(scope="module")
def want(fleet) -> dict[str, list[int]]:
    """What one instance answers alone, per endpoint (no reference: computed whole)."""
    answers = {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, ids, error = completion(fleet["fail"].url, False, path=path)
        assert status == 200 and len(ids) == 8, error
        answers[path] = ids
    return answers


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_through_the_proxy_every_answer_is_pulled_and_equals_one_instance(fleet, want, path):
    proxy = fleet.proxy(["d0", "d1"])
    for stream in (False, True, False):
        before, failed = pulls(fleet, "d0", "d1")
        assert completion(proxy.url, stream, path=path)[:2] == (200, want[path])
        after, failed_after = pulls(fleet, "d0", "d1")
        assert after > before, "the decode pulled nothing: no P/D happened"
        assert failed_after == failed, "a pull failed"


def test_n_choices_through_the_proxy_equal_one_instance_and_choice_0_pulls(fleet):
    """Of a request of two seeded choices, choice 0 takes the prefill's (or the client's)
    reference: it is pulled once; choice 1 computes the prompt. Both equal one instance's
    answer."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "n": 2, "seed": 11,
            "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}

    def choices(url: str) -> list[list[int]]:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer = sorted(response.json()["choices"], key=lambda choice: choice["index"])
        return [choice["token_ids"] for choice in answer]

    want = choices(fleet["fail"].url)
    assert len(want) == 2 and want[0] != want[1]
    proxy = fleet.proxy(["d0"])
    before, failed = pulls(fleet, "d0")
    assert choices(proxy.url) == want
    pulled, failed_after = pulls(fleet, "d0")
    assert failed_after == failed
    single = fleet.proxy(["d1"])
    alone_before, _ = pulls(fleet, "d1")
    assert completion(single.url, False)[0] == 200
    assert pulled - before == pulls(fleet, "d1")[0] - alone_before, "not one request's pull"
    # A client's own reference, too, goes with choice 0 alone (a second pull of it would
    # be refused: a failed pull).
    reference = httpx.post(f"{fleet['prefill'].url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 1}).json()["kv_transfer_params"]
    body["kv_transfer_params"] = reference
    assert choices(proxy.url) == want
    assert pulls(fleet, "d0") == (2 * pulled - before, failed)


def test_a_clients_own_reference_replaces_the_prefill(fleet, want):
    """The client prefilled itself: the proxy makes no prefill and the decode pulls the
    client's reference (a malformed one is the decode's 400); a client's other
    kv_transfer_params are not forwarded."""
    proxy = fleet.proxy(["d0"])
    path = "/v1/completions"
    answer = httpx.post(f"{fleet['prefill'].url}{path}", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}).json()
    reference = answer["kv_transfer_params"]
    served = served_requests(fleet["prefill"].url)
    before, _ = pulls(fleet, "d0")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": reference}
    response = httpx.post(f"{proxy.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == want[path]
    assert pulls(fleet, "d0")[0] > before
    assert served_requests(fleet["prefill"].url) == served
    body["kv_transfer_params"] = {"do_remote_decode": True}  # not a reference: dropped
    response = httpx.post(f"{proxy.url}{path}", json=body, timeout=60)
    assert response.json()["choices"][0]["token_ids"] == want[path]
    body["kv_transfer_params"] = {"do_remote_prefill": True}  # a malformed reference
    response = httpx.post(f"{proxy.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "kv_transfer_params"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_failed_pull_is_recomputed_behind_the_proxy(fleet, want, stream):
    proxy = fleet.proxy(["recompute"])
    url = fleet["recompute"].url
    failed = metric(url, FAILED)
    recovered = metric(url, "kvrecover_kv_load_recovered_requests_total")
    assert completion(proxy.url, stream)[:2] == (200, want["/v1/completions"])
    assert metric(url, FAILED) > failed
    assert metric(url, "kvrecover_kv_load_recovered_requests_total") == recovered + 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_policy_fail_fails_over_or_is_a_503_never_a_200_of_bad_kv(fleet, want, stream):
    """The decode's 503 kv_load_failed comes before any byte: the proxy sends the request
    on without the spent reference (the next instance computes it: a correct 200); with no
    retry left the client gets a 503."""
    url = fleet["fail"].url
    failed = metric(url, "kvrecover_kv_load_failed_requests_total")
    no_retry = fleet.proxy(["fail"], "--max-retries", "0")
    status, _, error = completion(no_retry.url, stream)
    assert status == 503 and "kv_load_failed" in error, (status, error)
    assert metric(url, "kvrecover_kv_load_failed_requests_total") == failed + 1
    proxy = fleet.proxy(["fail", "d1"])
    assert completion(proxy.url, stream)[:2] == (200, want["/v1/completions"])
    assert metric(url, "kvrecover_kv_load_failed_requests_total") == failed + 2
    assert metric(proxy.url, "kvrecover_proxy_failovers_total",
                  f'instance="{url}",role="decode"') == 1


def test_a_killed_decode_fails_over_and_the_next_pulls_the_reference(fleet, want):
    """d0 (the first candidate) is dead before the request: the connection is refused, the
    reference was never used, and d1 pulls it. A correct 200, not a 500."""
    proxy = fleet.proxy(["d0", "d1"])
    fleet["d0"].kill()
    for stream in (False, True):
        before, _ = pulls(fleet, "d1")
        assert completion(proxy.url, stream)[:2] == (200, want["/v1/completions"])
        assert pulls(fleet, "d1")[0] > before


def test_a_killed_prefill_is_retried_on_another_or_computed_by_the_decode(fleet, want):
    """`prefill` dies: a proxy with `prefill2` too retries the prefill there (d1 pulls its
    reference); one with no other prefill has the decode compute the prompt (no
    reference). A correct 200 either way, streamed or not."""
    both = fleet.proxy(["d1"], prefills=("prefill", "prefill2"))
    alone = fleet.proxy(["d1"])
    fleet["prefill"].kill()
    for stream in (False, True):
        before, failed = pulls(fleet, "d1")
        assert completion(both.url, stream)[:2] == (200, want["/v1/completions"])
        after, failed_after = pulls(fleet, "d1")
        assert after > before and failed_after == failed
        assert completion(alone.url, stream)[:2] == (200, want["/v1/completions"])
        assert pulls(fleet, "d1") == (after, failed), "pulled with no prefill alive"
    for proxy in (both, alone):
        assert metric(proxy.url, "kvrecover_proxy_retries_total",
                      f'instance="{fleet["prefill"].url}",role="prefill"') >= 1


def test_a_decode_killed_mid_stream_is_migrated_token_exact(fleet):
    """Runs last (it kills d1). d1 dies after its first chunk: the proxy continues the
    request on `recompute` (the continuation carries no reference, so nothing is pulled)
    and the whole stream equals one instance's."""
    max_tokens = 300
    alone = completion(fleet["fail"].url, False, max_tokens)
    assert alone[0] == 200 and len(alone[1]) == max_tokens
    proxy = fleet.proxy(["d1", "recompute"], prefills=("prefill2",))
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "ignore_eos": True, "return_token_ids": True}

    def read(on_open) -> tuple[list[int], bool]:
        with httpx.stream("POST", f"{proxy.url}/v1/completions", json=request,
                          timeout=60) as response:
            assert response.status_code == 200
            assert response.headers["x-kvrecover-decode-instance"] == fleet["d1"].url
            on_open(response)
            return streamed_token_ids(response)

    (ids, done), killed = read_killing_the_decode(fleet, proxy, read)
    assert done and ids == alone[1]
    assert metric(proxy.url, "kvrecover_proxy_migrations_total",
                  f'instance="{killed.url}",role="decode"') == 1
