"""A hybrid (Qwen3-Next) prompt's recurrent state travels with its KV through a store
connector (`kv_transfer/stores/state_entries.py`): a producer prefills, a consumer loads KV and
state and decodes the same tokens as a connector-free run, sync and async; a claim ends
at the last boundary whose state is stored; connectors that cannot carry states are
refused (the NixlConnector carries them: `tests/kv_transfer/p2p/test_nixl_hybrid.py`; a
TieredConnector with one store tier too, NIXL first or not)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import storage_transfer
from test_qwen3_next_vs_hf import FAMILIES, PROMPTS, build_hybrid, generate

from kvrecover import LLM, KVTransferConfig
from kvrecover.kv_layout import hash_block_tokens
from kvrecover.kv_transfer.stores.block_store import PREFIX_SIZE, BlockCodec
from kvrecover.kv_transfer.stores.state_entries import STATE_HEADER, state_key

BLOCK = 4


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory) -> Path:
    return build_hybrid(tmp_path_factory.mktemp("qwen3_next"), **FAMILIES["qwen3_next"])


@pytest.fixture(scope="module")
def baseline(qwen3_next_dir) -> list[list[int]]:
    return generate(LLM(str(qwen3_next_dir), block_size=BLOCK, device="cpu",
                        enable_prefix_caching=False))


def hybrid_llm(folder: Path, transfer: KVTransferConfig | None = None, **engine) -> LLM:
    settings = dict(block_size=BLOCK, device="cpu", max_num_batched_tokens=12,
                    enable_prefix_caching=False, kv_transfer_config=transfer)
    return LLM(str(folder), **{**settings, **engine})


def state_entries(store: Path) -> list[Path]:
    """The stored first chunks of recurrent states (their payload's magic), among the KV
    blocks."""
    return [path for path in store.rglob("*.kvblock")
            if path.read_bytes()[PREFIX_SIZE : PREFIX_SIZE + 4] == b"KVRS"]


def last_boundary_key(prompt: list[int]) -> bytes:
    block_hash = None
    for start in range(0, (len(prompt) - 1) // BLOCK * BLOCK, BLOCK):
        block_hash = hash_block_tokens(block_hash, prompt[start : start + BLOCK])
    assert block_hash is not None
    return state_key(block_hash)


def fill_store(folder: Path, store: Path) -> None:
    producer = hybrid_llm(folder, storage_transfer(store, "kv_producer"))
    generate(producer)
    producer.close()


@pytest.mark.parametrize("async_load", [False, True])
def test_consumer_decodes_from_the_producers_kv_and_state(qwen3_next_dir, baseline, tmp_path,
                                                          async_load):
    store = tmp_path / "store"
    fill_store(qwen3_next_dir, store)
    # One state entry per prompt, at its last loadable boundary, named by that block.
    assert len(state_entries(store)) == len(PROMPTS)
    for prompt in PROMPTS:
        assert any(last_boundary_key(prompt).hex() in path.name for path in state_entries(store))
    consumer = hybrid_llm(qwen3_next_dir, storage_transfer(store, "kv_consumer",
                                                           async_load=async_load))
    assert generate(consumer) == baseline
    loaded = sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)
    assert consumer.stats["prompt_tokens_external"] == loaded
    assert consumer.stats["prompt_tokens_computed"] == sum(map(len, PROMPTS)) - loaded


def test_a_claim_ends_at_the_last_boundary_whose_state_is_stored(qwen3_next_dir, baseline,
                                                                  tmp_path):
    """Every KV block is stored but the states are gone: nothing is claimed (the claim
    never outruns the states), and outputs stay the connector-free ones."""
    store = tmp_path / "store"
    fill_store(qwen3_next_dir, store)
    for path in state_entries(store):
        path.unlink()
    consumer = hybrid_llm(qwen3_next_dir, storage_transfer(store, "kv_consumer"))
    assert generate(consumer) == baseline
    assert consumer.stats["prompt_tokens_external"] == 0
    assert consumer.stats["prompt_tokens_computed"] == sum(map(len, PROMPTS))


def test_a_state_of_another_layout_is_a_failed_load_and_recomputed(qwen3_next_dir, baseline,
                                                                     tmp_path):
    """A stored state whose payload was altered fails its checksum: the request rolls back
    and recomputes, same tokens."""
    store = tmp_path / "store"
    fill_store(qwen3_next_dir, store)
    for path in state_entries(store):
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x5A
        path.write_bytes(bytes(raw))
    consumer = hybrid_llm(qwen3_next_dir, storage_transfer(store, "kv_consumer"))
    assert generate(consumer) == baseline
    assert consumer.stats["kv_load_failed_blocks"] >= len(PROMPTS)


def test_one_state_per_prompt_in_block_sized_chunks(qwen3_next_dir, tmp_path):
    """A prompt stores its full KV blocks and one state, in as few block-sized entries as
    hold the checkpoint and the 28-byte state header."""
    store = tmp_path / "store"
    producer = hybrid_llm(qwen3_next_dir, storage_transfer(store, "kv_producer"))
    (prompt,) = PROMPTS[2:]
    generate(producer, [prompt])
    checkpoint = producer.engine.model_runner.recurrent_states.bytes_per_checkpoint
    codec = BlockCodec(producer.engine.layout)
    files = list(store.rglob("*.kvblock"))
    assert all(path.stat().st_size == codec.entry_nbytes for path in files)
    num_chunks = len(files) - len(prompt) // BLOCK
    assert num_chunks == math.ceil((STATE_HEADER.size + checkpoint) / codec.payload_nbytes)
    assert len(state_entries(store)) == 1


def test_connectors_without_state_support_are_refused(qwen3_next_dir, tmp_path):
    module = tmp_path / "plain_connector.py"
    module.write_text("from kvrecover.kv_transfer.base import KVConnectorBase\n"
                      "class PlainConnector(KVConnectorBase):\n"
                      "    supports_kv_groups = True\n")
    transfer = KVTransferConfig("PlainConnector", "kv_both", {},
                                kv_connector_module_path=str(module))
    with pytest.raises(ValueError, match="does not store their states"):
        hybrid_llm(qwen3_next_dir, transfer)


def tiered_transfer(role: str, stores: list[Path], nixl: bool = False) -> KVTransferConfig:
    """A TieredConnector over these shared-storage folders, behind a NixlConnector if
    `nixl`."""
    connectors = [{"kv_connector": "NixlConnector"}] if nixl else []
    connectors += [{"kv_connector": "SharedStorageConnector",
                    "kv_connector_extra_config": {"shared_storage_path": str(store)}}
                   for store in stores]
    return KVTransferConfig("TieredConnector", role, {"connectors": connectors})


@pytest.mark.parametrize("nixl", [False, True], ids=["stores", "nixl-first"])
def test_more_than_one_store_tier_is_refused_for_a_hybrid_model(qwen3_next_dir, tmp_path,
                                                               nixl):
    """A hybrid's states live in one store (NIXL first or not: `tiered/connector.py`);
    two store tiers are refused at start-up, naming why."""
    transfer = tiered_transfer("kv_consumer", [tmp_path / "a", tmp_path / "b"], nixl)
    with pytest.raises(ValueError, match="exactly one block-store tier"):
        hybrid_llm(qwen3_next_dir, transfer)


def test_a_tiered_store_carries_the_states(qwen3_next_dir, baseline, tmp_path):
    """A TieredConnector of one store: the producer saves KV and states through it, the
    consumer loads both from it (NIXL first: `tests/kv_transfer/p2p/test_nixl_hybrid_tiers.py`)."""
    store = tmp_path / "store"
    producer = hybrid_llm(qwen3_next_dir, tiered_transfer("kv_producer", [store]))
    generate(producer)
    producer.close()
    assert len(state_entries(store)) == len(PROMPTS)
    consumer = hybrid_llm(qwen3_next_dir, tiered_transfer("kv_consumer", [store]))
    assert generate(consumer) == baseline
    loaded = sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)
    assert consumer.stats["prompt_tokens_external"] == loaded
    assert consumer.stats["kv_tier0_loaded_states"] == len(PROMPTS)


def test_a_producer_without_checkpoint_slots_is_refused(qwen3_next_dir, tmp_path):
    with pytest.raises(ValueError, match="num_state_checkpoints"):
        hybrid_llm(qwen3_next_dir, storage_transfer(tmp_path, "kv_producer"),
                   num_state_checkpoints=0)
