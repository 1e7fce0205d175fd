"""RedisConnector over a Redis Cluster whose primary fails over to a replica that lacks
the newest writes (issue 26, point 3): three primaries and one replica of the first.

The replica is cut off from its primary (`cut_replication`) after the first prompt's
blocks reached it, so the blocks the producer stores next exist only on the primary.
Then the primary is SIGKILLed and the replica promoted (`CLUSTER FAILOVER TAKEOVER`).
The connector must follow the new owner of the slots: the promoted replica serves the
blocks it has, and only the blocks it never received fail (between lookup and load) or
miss (at a later lookup). And a slot that no node serves (CLUSTER DELSLOTS) costs only
its keys. Outputs are compared token for token with an engine without any connector.
"""

from __future__ import annotations

import time

import pytest
from conftest import greedy_token_ids
from redis.crc import key_slot
from redis_cluster_helpers import ClusterNodeProcess, RedisClusterProcesses, wait_until
from redis_helpers import require_redis_server
from test_redis_cluster import (  # the same prompts, hook connector and runs
    BLOCK,
    LOADABLE_A,
    PROMPT_A,
    PROMPT_C,
    between_lookup_and_load,
    cluster_transfer,
    prefill,
    run,
)
from test_redis_connector import MAX_TOKENS, baseline, make_llm

from kvrecover.kv_layout import update_block_hashes

PROMPT_OLD = PROMPT_A[:100]  # A's first 6 blocks: replicated before the cut


@pytest.fixture
def cluster():
    require_redis_server()
    processes = RedisClusterProcesses(replicas=1).start()
    yield processes
    between_lookup_and_load.clear()
    processes.cleanup()


def store_with_a_stale_replica(model, cluster: RedisClusterProcesses
                               ) -> tuple[ClusterNodeProcess, ClusterNodeProcess, set[bytes]]:
    """Prefill PROMPT_OLD (replicated), cut the replica off, prefill PROMPT_A: the first
    primary, its replica, and the keys of A that the primary has and its replica lacks."""
    primary, replica = cluster.nodes[0], cluster.replicas[0]
    prefill(model, cluster.url, [PROMPT_OLD])
    assert primary.client().execute_command("WAIT", 1, 5000) == 1
    cluster.cut_replication(replica)
    stats = prefill(model, cluster.url, [PROMPT_A])
    assert stats["kv_save_failed_blocks"] == 0
    replicated = set(replica.client().keys("*"))
    missing = set(primary.client().keys("*")) - replicated
    # The seeds put both kinds of A's blocks on the first primary (else nothing is shown).
    assert replicated and missing
    return primary, replica, missing


def getrange_calls(node: ClusterNodeProcess) -> int:
    return node.client().info("commandstats").get("cmdstat_getrange", {}).get("calls", 0)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_failover_between_lookup_and_load_fails_only_the_blocks_the_replica_lacks(
        tiny_llama, cluster, async_load, policy):
    primary, replica, missing = store_with_a_stale_replica(tiny_llama, cluster)
    primary_keys = set(primary.client().keys("*"))
    planned: list[bytes] = []

    def fail_over(keys: list[bytes]) -> None:
        planned.extend(keys)
        primary.kill()
        cluster.promote(replica)

    timeout_s = 2.0
    between_lookup_and_load["hook"] = fail_over
    llm = make_llm(tiny_llama, cluster_transfer(cluster.url, "kv_consumer", policy, hooked=True,
                                                async_load=async_load, timeout_s=timeout_s))
    started = time.monotonic()
    outputs = run(llm, [PROMPT_A, PROMPT_C])
    elapsed = time.monotonic() - started
    expected = baseline(tiny_llama, [PROMPT_A, PROMPT_C])
    stats = llm.stats
    assert len(planned) == LOADABLE_A and missing <= set(planned)
    # The killed primary's blocks were read from the promoted replica; only those it never
    # received failed (the other primaries' blocks loaded as ever).
    assert getrange_calls(replica) == len(primary_keys)
    assert stats["kv_load_failed_blocks"] == len(missing)
    if policy == "fail":
        assert outputs[0].outputs[0].finish_reason == "error"
        assert stats["kv_load_failed_requests"] == 1
    else:
        assert outputs[0].outputs[0].token_ids == expected[0]
        assert stats["kv_load_recovered_requests"] == 1
    assert outputs[1].outputs[0].token_ids == expected[1]
    assert elapsed < 10 * timeout_s  # a refused primary is followed at once, never waited on
    llm.close()


def test_after_a_failover_a_lookup_finds_what_the_promoted_replica_has(tiny_llama, cluster):
    primary, replica, missing = store_with_a_stale_replica(tiny_llama, cluster)
    primary_keys = set(primary.client().keys("*"))
    llm = make_llm(tiny_llama, cluster_transfer(cluster.url, "kv_consumer", timeout_s=2.0))
    # Connected to every primary (the killed one too) before the failover.
    assert greedy_token_ids(llm, [PROMPT_C], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_C])
    assert getrange_calls(primary) == 0 and llm.stats["prompt_tokens_external"] == 0
    primary.kill()
    cluster.promote(replica)

    keys = block_keys(tiny_llama, cluster.url, PROMPT_A)
    first_missing = min(keys.index(key) for key in missing)
    assert min(keys.index(key) for key in primary_keys) < first_missing
    assert greedy_token_ids(llm, [PROMPT_A], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_A])
    # The lookup asked the promoted replica: the prefix up to the first block it lacks
    # loaded (not just up to the first block the killed primary served), none failed.
    assert llm.stats["prompt_tokens_external"] == first_missing * BLOCK
    assert llm.stats["kv_load_failed_blocks"] == 0
    llm.close()


# ----- a slot that no node serves (its owner forgot it: CLUSTER DELSLOTS) -----------------
@pytest.fixture
def cluster_without_replicas():
    require_redis_server()
    processes = RedisClusterProcesses().start()
    yield processes
    processes.cleanup()


def test_a_slot_no_node_serves_costs_only_its_blocks(tiny_llama, cluster_without_replicas):
    """A key whose slot no node serves is a miss; the other keys of the same call, on
    every node, are still answered (redis-py's SlotNotCoveredError is no RedisError)."""
    cluster = cluster_without_replicas
    prefill(tiny_llama, cluster.url, [PROMPT_A])
    keys = block_keys(tiny_llama, cluster.url, PROMPT_A)
    lost_index = LOADABLE_A // 2
    slot = key_slot(keys[lost_index])
    assert all(key_slot(key) != slot for key in keys[:lost_index])
    for node in cluster.nodes:
        node.client().execute_command("CLUSTER", "DELSLOTS", slot)
    wait_until(lambda: all(slot not in covered_slots(n) for n in cluster.nodes),
               "the slot to be served by no node")

    consumer = make_llm(tiny_llama, cluster_transfer(cluster.url, "kv_consumer"))
    assert greedy_token_ids(consumer, [PROMPT_A], MAX_TOKENS) == baseline(tiny_llama, [PROMPT_A])
    # The blocks before the unserved one were found and loaded, from their nodes.
    assert consumer.stats["prompt_tokens_external"] == lost_index * BLOCK
    assert consumer.stats["kv_load_failed_blocks"] == 0
    consumer.close()


def block_keys(model, url: str, prompt: list[int]) -> list[bytes]:
    """The Redis keys of `prompt`'s loadable blocks, in order."""
    llm = make_llm(model, cluster_transfer(url, "kv_consumer"))
    store = llm.engine.model_runner.connector.store
    hashes: list[bytes] = []
    update_block_hashes(hashes, prompt, BLOCK)
    llm.close()
    return [store.redis_key(key) for key in hashes[:(len(prompt) - 1) // BLOCK]]


def covered_slots(node: ClusterNodeProcess) -> set[int]:
    ranges = node.client().execute_command("CLUSTER", "SLOTS")
    return {slot for start, end, *_ in ranges for slot in range(int(start), int(end) + 1)}
