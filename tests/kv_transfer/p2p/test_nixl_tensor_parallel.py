"""NixlConnector at tensor_parallel_size 2: each producer rank serves its own shard on
side channel port + rank, each consumer rank pulls from the producer rank of its own
number; a failure on one rank fails those blocks on every rank (the union), and a
reference of another size is computed here. A hybrid's recurrent state travels per rank
as its KV does. Token ids are always those of a run without a transfer at the consumer's
size."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import random_prompts, require_nixl
from models.test_qwen3_next_vs_hf import FAMILIES, build_hybrid
from test_nixl_connector import PROMPTS, Producer, with_references
from test_nixl_hybrid import HybridProducer

from kvrecover import LLM, KVTransferConfig

require_nixl()

# 7, 5 and 6 full blocks below the last token (block size 8): a pull's last position,
# 6, 4 and 5, tells the requests apart on a consumer rank.
LENGTHS = [61, 45, 53]
FULL_BLOCKS = sum((n - 1) // 8 for n in LENGTHS)
SETS = random_prompts(9, LENGTHS, 384, seed=42)
FIRST, SECOND, THIRD = SETS[:3], SETS[3:6], SETS[6:]  # each pulled once per producer

RANK_ONE_FAILS = '''
from dataclasses import replace

from kvrecover.kv_transfer.p2p.consumer import NixlConsumer
from kvrecover.kv_transfer.p2p.nixl_connector import NixlConnector


class RankOneFails(NixlConsumer):
    """Consumer rank 1 only: the 7-block prompt's checksums say its first block differs
    (a bad shard); the 5-block prompt's producer rank is unreachable (a dead port)."""

    def _check(self, pull, deadline):
        if self.rank == 1 and pull.last_position == 4:
            pull.reference = replace(pull.reference, port={dead_port} - 1)
        peer, checksums = super()._check(pull, deadline)
        if self.rank == 1 and pull.last_position == 6:
            checksums = [checksums[0] ^ 1, *checksums[1:]]
        return peer, checksums


class NixlRankOneFails(NixlConnector):
    consumer_class = RankOneFails
'''


def free_port_pair() -> int:
    """A port P with P + 1 free too (a size-2 producer serves both)."""
    while True:
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def size_2_producer(model: Path, prompts: list[list[int]], kind: type = Producer) -> Producer:
    producer = kind(model, port=free_port_pair(), prompts=prompts,
                    engine={"tensor_parallel_size": 2})
    Producer.started.remove(producer.process)  # this module kills its own
    return producer


def stop(producer: Producer) -> None:
    if producer.process.poll() is None:
        producer.kill()


def consumer(model: Path, size: int, *, async_load: bool = False, policy: str = "recompute",
             module: Path | None = None) -> LLM:
    """A consumer without prefix caching: its runs without references are the baseline."""
    transfer = KVTransferConfig(
        "NixlConnector" if module is None else "NixlRankOneFails", "kv_consumer",
        {"load_timeout_s": 10.0, "async_load": async_load}, kv_load_failure_policy=policy,
        kv_connector_module_path=None if module is None else str(module))
    return LLM(str(model), device="cpu", block_size=8, num_kv_blocks=128,
               tensor_parallel_size=size, enable_prefix_caching=False,
               kv_transfer_config=transfer)


def generate(llm: LLM, prompts: list[list[int]], references: list | None = None):
    """(outputs, token ids, blocks pulled by every rank together)."""
    before = llm.stats.get("kv_nixl_pulled_blocks", 0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           with_references(references or [None] * len(prompts)))
    return (outputs, [o.outputs[0].token_ids for o in outputs],
            llm.stats.get("kv_nixl_pulled_blocks", 0) - before)


@pytest.fixture(scope="module")
def shared_producer(tiny_llama):
    """A size-2 producer of FIRST and SECOND (one rank failing) and THIRD (a size-1
    consumer)."""
    producer = size_2_producer(tiny_llama, FIRST + SECOND + THIRD)
    yield producer
    stop(producer)


def test_each_rank_pulls_its_own_shard_sync_and_async(tiny_llama):
    """And a size-1 producer's references at this size-2 consumer are computed here."""
    producer = size_2_producer(tiny_llama, FIRST + SECOND)
    size_1_producer = Producer(tiny_llama, prompts=THIRD)
    Producer.started.remove(size_1_producer.process)
    try:
        with consumer(tiny_llama, 2) as sync:
            _, baseline, _ = generate(sync, FIRST + SECOND + THIRD)
            outputs, ids, pulled = generate(sync, FIRST, producer.references[:3])
            assert ids == baseline[:3]
            assert pulled == 2 * FULL_BLOCKS  # each rank its own shard of every block
            assert all(o.error is None for o in outputs)
            outputs, ids, pulled = generate(sync, THIRD, size_1_producer.references)
            assert ids == baseline[6:] and pulled == 0
            assert all(o.error is None for o in outputs)
        with consumer(tiny_llama, 2, async_load=True) as pulling_async:
            _, ids, pulled = generate(pulling_async, SECOND, producer.references[3:])
            assert ids == baseline[3:6] and pulled == 2 * FULL_BLOCKS
        assert producer.finish() == 0  # released by both ranks: nothing stays pinned
    finally:
        stop(producer)
        stop(size_1_producer)


def test_one_ranks_failure_fails_those_blocks_on_every_rank(tiny_llama, shared_producer,
                                                            tmp_path):
    module = tmp_path / "rank_one_fails.py"
    module.write_text(RANK_ONE_FAILS.format(dead_port=free_port_pair()))
    with consumer(tiny_llama, 2, module=module) as recompute:
        _, baseline, _ = generate(recompute, FIRST + SECOND)
        _, ids, pulled = generate(recompute, FIRST, shared_producer.references[:3])
        stats = recompute.stats
    assert ids == baseline[:3]
    # Rank 0 pulls every block; rank 1 all but the bad one and the unreachable prompt's.
    assert pulled == 2 * FULL_BLOCKS - 1 - 5
    assert stats["kv_load_failed_blocks"] >= 1 + 5
    with consumer(tiny_llama, 2, policy="fail", module=module) as failing:
        outputs, ids, _ = generate(failing, SECOND, shared_producer.references[3:6])
    for failed in outputs[:2]:
        assert failed.outputs[0].finish_reason == "error"
        assert failed.error_type == "kv_load_failed" and failed.outputs[0].token_ids == []
    assert ids[2] == baseline[5] and outputs[2].error is None


def test_a_reference_of_another_size_is_computed_here(tiny_llama, shared_producer, caplog):
    with consumer(tiny_llama, 1) as size_1:
        _, baseline, _ = generate(size_1, THIRD)
        outputs, ids, pulled = generate(size_1, THIRD, shared_producer.references[6:])
    assert ids == baseline and pulled == 0
    assert all(o.error is None for o in outputs)
    assert "producer at tensor_parallel_size 2, this engine runs 1" in caplog.text


def test_a_hybrids_state_is_pulled_per_rank(tmp_path_factory):
    """Qwen3-Next, async: each rank pulls its own heads' state with its blocks (12 blocks
    and a state per rank), installs it, and both ranks release blocks and state."""
    model = build_hybrid(tmp_path_factory.mktemp("qwen3_next"), **FAMILIES["qwen3_next"])
    producer = size_2_producer(model, PROMPTS, kind=HybridProducer)
    try:
        with consumer(model, 2, async_load=True) as pulling:
            _, baseline, _ = generate(pulling, PROMPTS)
            _, ids, pulled = generate(pulling, PROMPTS, producer.references)
            failed = pulling.stats.get("kv_load_failed_blocks", 0)
        assert ids == baseline and pulled == 2 * (7 + 5) and failed == 0
        assert producer.finish_with_states() == (0, 0)  # rank 0's states; HELD: every rank's
    finally:
        stop(producer)
