"""RedisConnector over a real three-node Redis Cluster (issue 26): disaggregated prefill
and decode through the cluster, and a node lost between lookup and load (killed or
paused), a save to a lost node, a node restarted empty, and slots moving during a run.

Each test starts its own cluster (tests/redis_cluster_helpers.py) on loopback ports.
Outputs are compared token for token with an engine without any connector; a lost
node's cost is asserted from the stats: exactly the prompt's blocks whose keys hash to
that node fail.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import greedy_token_ids
from redis.crc import key_slot
from redis_cluster_helpers import RedisClusterProcesses
from redis_helpers import LARGE_LAYOUT, peak_allocation, require_redis_server, sealed_entries
from test_redis_connector import MAX_TOKENS, baseline, make_llm  # the same engine and runs

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.kv_transfer.redis.cluster_store import RedisClusterBlockStore
from kvrecover.kv_transfer.redis.connector import RedisConnector
from kvrecover.kv_transfer.redis.store import RedisSettings

VOCAB = 384  # the tiny models of conftest.py
BLOCK = 16
# A: 12 loadable blocks (spread over the three nodes); B: 3; C is never stored.
PROMPT_A = [random.Random(11).randrange(2, VOCAB) for _ in range(200)]
PROMPT_B = [random.Random(12).randrange(2, VOCAB) for _ in range(50)]
PROMPT_C = [random.Random(13).randrange(2, VOCAB) for _ in range(40)]
LOADABLE_A = (len(PROMPT_A) - 1) // BLOCK

# What the hook connector below does between a request's lookup and its load (set by a
# test, run once on the scheduler's connector: the engine runs both roles in-process).
between_lookup_and_load: dict[str, Callable[[list[bytes]], None]] = {}


class HookedRedisConnector(RedisConnector):
    """Runs `between_lookup_and_load["hook"]` once, with the Redis keys of the first
    load that the lookup planned, before any load starts."""

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        hook = between_lookup_and_load.pop("hook", None)
        if hook is not None and num_external_tokens > 0:
            first = request.num_computed_tokens // self.block_size
            keys = request.block_hashes[first : first + num_external_tokens // self.block_size]
            hook([self.store.redis_key(key) for key in keys])
        super().update_state_after_alloc(request, block_ids, num_external_tokens)


@pytest.fixture
def cluster():
    require_redis_server()
    processes = RedisClusterProcesses().start()
    yield processes
    between_lookup_and_load.clear()
    processes.cleanup()


def cluster_transfer(url: str, role: str = "kv_both", policy: str = "recompute",
                     hooked: bool = False, recompute: str = "prefix", **extra) -> KVTransferConfig:
    return KVTransferConfig("HookedRedisConnector" if hooked else "RedisConnector", role,
                            {"url": url, **extra}, kv_load_failure_policy=policy,
                            kv_connector_module_path=__name__ if hooked else None,
                            kv_load_recompute=recompute)


def prefill(model: Path, url: str, prompts: list[list[int]]) -> dict:
    llm = make_llm(model, cluster_transfer(url, "kv_producer"))
    greedy_token_ids(llm, prompts, 1)
    llm.close()
    return llm.stats


def run(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def busiest_node(cluster: RedisClusterProcesses, keys: list[bytes]):
    """The node holding most of `keys` (by `cluster slots` and each key's slot), and how
    many of them it holds."""
    owners = [cluster.node_of_slot(key_slot(key)).port for key in keys]
    port = max(set(owners), key=owners.count)
    return next(n for n in cluster.nodes if n.port == port), owners.count(port)


# ----- prefill and decode through the cluster ----------------------------------------------
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_decode_loads_what_prefill_stored_across_the_nodes(tiny_llama, cluster, async_load):
    prompts = [PROMPT_A, PROMPT_B, PROMPT_C]
    stats = prefill(tiny_llama, cluster.url, [PROMPT_A, PROMPT_B])
    assert stats["kv_save_failed_blocks"] == 0
    keys = cluster.keys()
    assert sum(map(len, keys.values())) == LOADABLE_A + 3
    assert sum(1 for node_keys in keys.values() if node_keys) >= 2  # spread by key slot
    for port, node_keys in keys.items():  # every key sits on the node serving its slot
        assert all(cluster.node_of_key(key).port == port for key in node_keys)
    before = {n.port: n.client().info("commandstats") for n in cluster.nodes}

    llm = make_llm(tiny_llama, cluster_transfer(cluster.url, "kv_consumer",
                                                async_load=async_load))
    assert greedy_token_ids(llm, prompts, MAX_TOKENS) == baseline(tiny_llama, prompts)
    assert llm.stats["prompt_tokens_external"] == (LOADABLE_A + 3) * BLOCK
    assert llm.stats["kv_load_failed_blocks"] == 0
    assert isinstance(llm.engine.model_runner.connector.store, RedisClusterBlockStore)
    for node in cluster.nodes:  # one bounded GETRANGE per block, on the node of its key
        commands = node.client().info("commandstats")
        reads = commands.get("cmdstat_getrange", {}).get("calls", 0) - before[node.port].get(
            "cmdstat_getrange", {}).get("calls", 0)
        assert reads == len(keys[node.port])
    llm.close()


# ----- a node lost between lookup and load ----------------------------------------------
@pytest.mark.parametrize("policy, recompute", [("recompute", "prefix"), ("fail", "prefix"),
                                               ("recompute", "blocks")])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_node_killed_between_lookup_and_load_costs_only_its_blocks(tiny_llama, cluster,
                                                                      async_load, policy,
                                                                      recompute):
    prefill(tiny_llama, cluster.url, [PROMPT_A])
    lost: dict = {}

    def kill_busiest(keys: list[bytes]) -> None:
        node, count = busiest_node(cluster, keys)
        lost.update(count=count, planned=len(keys))
        node.kill()

    between_lookup_and_load["hook"] = kill_busiest
    llm = make_llm(tiny_llama, cluster_transfer(cluster.url, "kv_consumer", policy, hooked=True,
                                                recompute=recompute, async_load=async_load,
                                                timeout_s=2.0))
    started = time.monotonic()
    outputs = run(llm, [PROMPT_A, PROMPT_C])
    elapsed = time.monotonic() - started
    expected = baseline(tiny_llama, [PROMPT_A, PROMPT_C])
    stats = llm.stats
    assert lost["planned"] == LOADABLE_A and 0 < lost["count"] < LOADABLE_A
    # Only the lost node's blocks failed: the other nodes' blocks of A still loaded.
    assert stats["kv_load_failed_blocks"] == lost["count"]
    if policy == "fail":
        assert outputs[0].outputs[0].finish_reason == "error"
        assert stats["kv_load_failed_requests"] == 1
    else:
        assert outputs[0].outputs[0].token_ids == expected[0]
        assert stats["kv_load_recovered_requests"] == 1
    if recompute == "blocks":
        # Exactly the lost node's blocks are recomputed (and, after a sync load, A's
        # tokens that its load step computed on top of them); the rest loaded.
        tail = 0 if async_load else len(PROMPT_A) - LOADABLE_A * BLOCK
        assert stats["kv_load_recomputed_tokens"] == lost["count"] * BLOCK + tail
        assert stats["prompt_tokens_external"] == (LOADABLE_A - lost["count"]) * BLOCK
    assert outputs[1].outputs[0].token_ids == expected[1]
    assert elapsed < 30  # a refused node fails at once, never a wait
    llm.close()


def test_a_paused_node_costs_its_blocks_within_timeout_s_and_then_recovers(tiny_llama,
                                                                           cluster):
    prefill(tiny_llama, cluster.url, [PROMPT_A, PROMPT_B])
    lost: dict = {}

    def pause_busiest(keys: list[bytes]) -> None:
        node, count = busiest_node(cluster, keys)
        lost.update(node=node, count=count)
        node.pause()  # SIGSTOP: connections stay open, nothing answers

    timeout_s = 1.0
    between_lookup_and_load["hook"] = pause_busiest
    llm = make_llm(tiny_llama, cluster_transfer(cluster.url, "kv_consumer", hooked=True,
                                                timeout_s=timeout_s))
    try:
        started = time.monotonic()
        outputs = run(llm, [PROMPT_A])
        elapsed = time.monotonic() - started
    finally:
        if lost:
            lost["node"].resume()
    assert outputs[0].outputs[0].token_ids == baseline(tiny_llama, [PROMPT_A])[0]
    assert llm.stats["kv_load_failed_blocks"] == lost["count"] > 0
    # The load waited timeout_s for the paused node, then its lookups answered at once.
    assert elapsed < 20 * timeout_s
    # SIGCONT: once its back-off (timeout_s) is over, the node serves again.
    time.sleep(timeout_s)
    assert greedy_token_ids(llm, [PROMPT_B], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_B])
    assert llm.stats["prompt_tokens_external"] >= 3 * BLOCK
    assert llm.stats["kv_load_failed_blocks"] == lost["count"]
    llm.close()


def test_saves_to_a_lost_node_are_counted_and_it_serves_again_restarted_empty(tiny_llama,
                                                                             cluster):
    from kvrecover.kv_layout import update_block_hashes

    producer = make_llm(tiny_llama, cluster_transfer(cluster.url, "kv_producer", timeout_s=2.0))
    store = producer.engine.model_runner.connector.store
    hashes: list[bytes] = []
    update_block_hashes(hashes, PROMPT_A, BLOCK)
    keys = [store.redis_key(key) for key in hashes[:LOADABLE_A]]
    victim, count = busiest_node(cluster, keys)
    victim.kill()
    started = time.monotonic()
    assert greedy_token_ids(producer, [PROMPT_A], 1) == [baseline(tiny_llama, [PROMPT_A])[0][:1]]
    assert time.monotonic() - started < 30
    assert producer.stats["kv_save_failed_blocks"] == count
    stored = [set(n.client().keys("*")) for n in cluster.nodes if n.process is not None]
    assert sum(map(len, stored)) == LOADABLE_A - count
    producer.close()

    victim.start(cluster.binary)  # back, empty, with its slots (nodes.conf)
    cluster.wait_ok()
    consumer = make_llm(tiny_llama, cluster_transfer(cluster.url, "kv_both"))
    assert greedy_token_ids(consumer, [PROMPT_A], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_A])
    assert consumer.stats["kv_load_failed_blocks"] == 0  # its keys are a miss, not a failure
    # The recomputed blocks were saved again, the restarted node's too.
    assert sum(map(len, cluster.keys().values())) == LOADABLE_A
    consumer.close()


# ----- slots moving during a run --------------------------------------------------------
@pytest.mark.parametrize("how", ["moved", "ask"])
def test_slots_moving_between_lookup_and_load_still_load(tiny_llama, cluster, how):
    prefill(tiny_llama, cluster.url, [PROMPT_A])
    moved: list[int] = []

    def move_slots(keys: list[bytes]) -> None:
        source, _ = busiest_node(cluster, keys)
        target = next(n for n in cluster.nodes if n is not source)
        for key in keys:
            slot = key_slot(key)
            if cluster.node_of_slot(slot) is source and slot not in moved:
                # "ask": the key moves but the slot stays migrating, so the old owner
                # answers ASK; "moved": the whole slot moves, so it answers MOVED.
                cluster.move_slot(slot, target, keys_to_move=1 if how == "ask" else None)
                moved.append(slot)

    between_lookup_and_load["hook"] = move_slots
    llm = make_llm(tiny_llama, cluster_transfer(cluster.url, "kv_consumer", hooked=True))
    started = time.monotonic()
    assert greedy_token_ids(llm, [PROMPT_A], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_A])
    assert time.monotonic() - started < 30
    assert moved
    if how == "moved":  # redis-py follows MOVED: every block loads
        assert llm.stats["prompt_tokens_external"] == LOADABLE_A * BLOCK
        assert llm.stats["kv_load_failed_blocks"] == 0
    else:
        # redis-py 8.1's asyncio client may send ASKING on another pooled connection than
        # the command it allows ("TTL exhausted"): a block mid-migration may fail, and
        # then it is only that block, recomputed.
        assert llm.stats["kv_load_failed_blocks"] <= len(moved)
    llm.close()


def test_each_node_gets_its_large_entries_without_a_copy_of_the_batch(cluster):
    """Every node's pipeline sends entry by entry from the entries' own memory (redis-py's
    asyncio writer joined each pipeline into one bytes and buffered it, issue 29)."""
    store = RedisClusterBlockStore(LARGE_LAYOUT, RedisSettings(url=cluster.url))
    entries = sealed_entries(store, 24)
    assert store.write_many(entries[:3]) == 0  # discovered and connected before measuring
    failed: list[int] = []
    peak = peak_allocation(lambda: failed.append(store.write_many(entries)))
    store.close()
    assert failed == [0]
    assert peak < 5 * store.entry_nbytes, f"{peak} bytes allocated to send 24 entries"
    assert sum(len(found) for found in cluster.keys().values()) == 24


def test_cluster_url_is_validated_without_showing_the_password(tiny_llama):
    with pytest.raises(ValueError, match=r"\['url'\] must be .*redis\+cluster://") as error:
        make_llm(tiny_llama, cluster_transfer("redis+cluster://:hunter2@127.0.0.1:7000,nohost"))
    assert "hunter2" not in str(error.value)
    with pytest.raises(ValueError, match="redis\\+cluster"):
        make_llm(tiny_llama, cluster_transfer("redis+cluster://127.0.0.1:7000/3"))


def test_seed_nodes_that_never_answer_cost_a_bounded_wait(tiny_llama):
    from redis_helpers import SilentServer

    silent = SilentServer()
    try:
        llm = make_llm(tiny_llama, cluster_transfer(
            f"redis+cluster://127.0.0.1:{silent.port}", timeout_s=0.5))
        started = time.monotonic()
        result = greedy_token_ids(llm, [PROMPT_B], MAX_TOKENS)
        assert result == baseline(tiny_llama, [PROMPT_B])
        assert time.monotonic() - started < 30
        assert llm.stats["prompt_tokens_external"] == 0
        assert llm.stats["kv_save_failed_blocks"] == 3
        llm.close()
    finally:
        silent.stop()


# ----- the reference scenario on a cluster -------------------------------------------------
@pytest.mark.slow
def test_scenario_runs_against_a_cluster(tmp_path, cluster):
    import json
    import os
    import subprocess
    import sys

    from conftest import build_tiny_model

    from kvrecover import scenario

    model = build_tiny_model(tmp_path / "model", seed=4, max_position_embeddings=4096)
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [sys.executable, "-m", "kvrecover", "scenario", "--model", str(model), "--device", "cpu",
         "--workdir", str(tmp_path / "work"), "--store", cluster.url],
        capture_output=True, text=True, timeout=1200, env=environment)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert not (tmp_path / "work" / scenario.STORAGE_DIR).exists()  # the KV went to the cluster
    assert sum(1 for keys in cluster.keys().values() if keys) == 3
    stats = json.loads((tmp_path / "work" / "decode_output.stats.json").read_text())
    assert stats["prompt_tokens_external"] > 0
