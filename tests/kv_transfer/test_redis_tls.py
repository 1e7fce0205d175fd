"""RedisConnector over TLS (issue 26): a three-node Redis Cluster that speaks TLS only
(`--port 0 --tls-port`, TLS on the cluster bus and to replicas, client certificates
required) through `rediss+cluster://`, and one server through `rediss://`, both given
the CA and the client certificate in the URL's query, as redis-py reads it.

The CA, certificate and key are made for each test with the openssl CLI (tmp_path).
Outputs are compared token for token with an engine without any connector.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis
from conftest import greedy_token_ids
from redis_cluster_helpers import RedisClusterProcesses, TLSFiles, wait_until
from redis_helpers import free_port, require_redis_server
from test_redis_cluster import LOADABLE_A, PROMPT_A, PROMPT_B, PROMPT_C, cluster_transfer, prefill
from test_redis_connector import MAX_TOKENS, baseline, make_llm

from kvrecover import KVTransferConfig
from kvrecover.kv_transfer.redis.cluster_store import RedisClusterBlockStore
from kvrecover.kv_transfer.redis.urls import parse_cluster_url

BLOCK = 16


@pytest.fixture
def tls_files(tmp_path) -> TLSFiles:
    require_redis_server()
    return TLSFiles.make(tmp_path / "tls")


@pytest.fixture
def tls_cluster(tls_files):
    processes = RedisClusterProcesses(tls=tls_files).start()
    yield processes
    processes.cleanup()


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_decode_loads_what_prefill_stored_through_a_tls_cluster(tiny_llama, tls_cluster,
                                                                async_load):
    url = tls_cluster.url
    assert url.startswith("rediss+cluster://") and "ssl_ca_certs=" in url
    prompts = [PROMPT_A, PROMPT_B, PROMPT_C]
    stats = prefill(tiny_llama, url, [PROMPT_A, PROMPT_B])
    assert stats["kv_save_failed_blocks"] == 0
    keys = tls_cluster.keys()
    assert sum(map(len, keys.values())) == LOADABLE_A + 3
    assert sum(1 for node_keys in keys.values() if node_keys) >= 2  # spread over the nodes

    llm = make_llm(tiny_llama, cluster_transfer(url, "kv_consumer", async_load=async_load))
    assert greedy_token_ids(llm, prompts, MAX_TOKENS) == baseline(tiny_llama, prompts)
    assert llm.stats["prompt_tokens_external"] == (LOADABLE_A + 3) * BLOCK
    assert llm.stats["kv_load_failed_blocks"] == 0
    assert isinstance(llm.engine.model_runner.connector.store, RedisClusterBlockStore)
    llm.close()


def test_a_tls_cluster_without_the_ca_costs_a_bounded_wait_and_no_output(tiny_llama,
                                                                         tls_cluster):
    """Without `ssl_ca_certs` the nodes' certificate is not trusted: nothing is stored
    nor loaded, every save is counted, and the output is still exact."""
    tls = tls_cluster.tls
    seeds = tls_cluster.url.partition("?")[0]
    untrusting = f"{seeds}?ssl_certfile={tls.cert}&ssl_keyfile={tls.key}"
    llm = make_llm(tiny_llama, cluster_transfer(untrusting, timeout_s=1.0))
    started = time.monotonic()
    assert greedy_token_ids(llm, [PROMPT_B], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_B])
    assert time.monotonic() - started < 20
    assert llm.stats["prompt_tokens_external"] == 0
    assert llm.stats["kv_save_failed_blocks"] == 3
    llm.close()
    assert sum(map(len, tls_cluster.keys().values())) == 0


@pytest.fixture
def tls_server(tls_files, tmp_path):
    """One redis-server (no cluster) on a TLS-only loopback port."""
    port = free_port()
    process = subprocess.Popen(
        [shutil.which("redis-server"), *tls_files.server_args(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path), "--daemonize", "no",
         "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1,
                         socket_connect_timeout=1, **tls_files.client_kwargs())

    def pings() -> bool:
        if process.poll() is not None:
            raise RuntimeError("the TLS redis-server exited at start")
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    try:
        wait_until(pings, "a TLS redis-server to start")
        yield port, client
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_one_server_over_rediss_takes_the_same_tls_options(tiny_llama, tls_files,
                                                           tls_server):
    port, client = tls_server
    url = f"rediss://127.0.0.1:{port}/0{tls_files.url_query()}"

    def transfer(role: str) -> KVTransferConfig:
        return KVTransferConfig("RedisConnector", role, {"url": url})

    producer = make_llm(tiny_llama, transfer("kv_producer"))
    greedy_token_ids(producer, [PROMPT_B], 1)
    producer.close()
    assert producer.stats["kv_save_failed_blocks"] == 0 and client.dbsize() == 3
    consumer = make_llm(tiny_llama, transfer("kv_consumer"))
    prompts = [PROMPT_B, PROMPT_C]
    assert greedy_token_ids(consumer, prompts, MAX_TOKENS) == baseline(tiny_llama, prompts)
    assert consumer.stats["prompt_tokens_external"] == 3 * BLOCK
    consumer.close()


@pytest.mark.parametrize(("url", "problem"), [
    ("redis+cluster://127.0.0.1:7000?ssl_ca_certs=/ca.crt", "TLS options need a rediss"),
    ("rediss+cluster://:hunter2@127.0.0.1:7000?socket_timeout=60",
     "may set only ssl_ca_certs, .*got socket_timeout"),
])
def test_a_cluster_url_takes_only_tls_options_and_only_with_tls(tiny_llama, url, problem):
    with pytest.raises(ValueError, match=problem) as error:
        parse_cluster_url(url)
    assert "hunter2" not in str(error.value)
    with pytest.raises(ValueError, match=r"\['url'\] must be .*whose query may set only") as error:
        make_llm(tiny_llama, cluster_transfer(url))
    assert "hunter2" not in str(error.value)


def test_a_cluster_urls_tls_options_are_typed_as_for_rediss():
    parsed = parse_cluster_url("rediss+cluster://127.0.0.1:7000,127.0.0.1:7001"
                               "?ssl_ca_certs=/etc/ca%20file.crt&ssl_check_hostname=false")
    assert parsed.seeds == (("127.0.0.1", 7000), ("127.0.0.1", 7001))
    assert parsed.client_options() == {"ssl": True, "ssl_ca_certs": "/etc/ca file.crt",
                                       "ssl_check_hostname": False}
    assert parse_cluster_url("redis+cluster://127.0.0.1:7000").client_options() == {}
