"""The connector contract's seams: declared defaults, wrappers that use and forward
them, and connectors that only read `request.block_hashes`."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import greedy_token_ids

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.engine.request import Request
from kvrecover.kv_layout import KVCacheLayout, update_block_hashes
from kvrecover.kv_transfer.base import DEFAULT_LOAD_TIMEOUT_S, KVConnectorBase, KVConnectorRole
from kvrecover.kv_transfer.faults import FaultInjectionConnector
from kvrecover.kv_transfer.registry import register_connector
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector
from kvrecover.step_messages import SchedulerOutput

BLOCK = 4
LAYOUT = KVCacheLayout("seams-test", torch.float32, BLOCK, 2, 2, 8)


class RecordingConnector(KVConnectorBase):
    """A connector with no raw reads that records what wrappers ask of it."""

    load_timeout_s = 7.5

    def __init__(self, *args):
        super().__init__(*args)
        self.discarded: list[set[str]] = []

    def discard_saves_for(self, request_ids: set[str]) -> None:
        self.discarded.append(set(request_ids))


register_connector("RecordingConnector", f"{__name__}:RecordingConnector")


def make_request(token_ids: list[int], num_prompt_tokens: int) -> Request:
    request = Request("r", None, token_ids[:num_prompt_tokens], SamplingParams(), frozenset(), 0, 1024)
    request.token_ids = list(token_ids)  # as after decoding a few tokens
    update_block_hashes(request.block_hashes, request.prompt_token_ids, BLOCK)  # the engine's job
    return request


def test_base_class_declares_safe_defaults():
    config = KVTransferConfig("RecordingConnector", "kv_both")
    connector = KVConnectorBase(config, KVConnectorRole.WORKER, LAYOUT)
    assert connector.load_timeout_s == DEFAULT_LOAD_TIMEOUT_S
    assert connector.set_read_filter(lambda *args: args[3]) is False
    assert connector.discard_saves_for({"r"}) is None


def test_fault_wrapper_uses_and_forwards_the_inner_connectors_seams():
    config = KVTransferConfig("FaultInjectionConnector", "kv_both",
                              {"inner_connector": "RecordingConnector"})
    wrapper = FaultInjectionConnector(config, KVConnectorRole.WORKER, LAYOUT)
    assert isinstance(wrapper.inner, RecordingConnector)
    assert wrapper.load_timeout_s == 7.5  # the inner connector's deadline
    assert wrapper._filters_reads is False  # no raw reads: faults are emulated around loads
    wrapper.discard_saves_for({"a", "b"})
    assert wrapper.inner.discarded == [{"a", "b"}]


def test_fault_wrapper_filters_the_storage_connectors_raw_reads(tmp_path):
    config = KVTransferConfig("FaultInjectionConnector", "kv_both",
                              {"shared_storage_path": str(tmp_path), "load_timeout_s": 3.0})
    wrapper = FaultInjectionConnector(config, KVConnectorRole.WORKER, LAYOUT)
    assert isinstance(wrapper.inner, SharedStorageConnector)
    assert wrapper._filters_reads is True
    assert wrapper.inner._read_filter == wrapper._filter_read
    assert wrapper.load_timeout_s == 3.0


def test_storage_connector_reads_block_hashes_and_never_extends_them(tmp_path):
    """Hashes cover the prompt only; the connector must not hash the decoded tokens."""
    config = KVTransferConfig("SharedStorageConnector", "kv_both",
                              {"shared_storage_path": str(tmp_path)})
    connector = SharedStorageConnector(config, KVConnectorRole.SCHEDULER, LAYOUT)
    request = make_request(list(range(1, 20)), num_prompt_tokens=11)  # 2 full prompt blocks
    hashes = list(request.block_hashes)
    assert len(hashes) == 2
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)  # nothing stored yet
    connector.update_state_after_alloc(request, [1, 2, 3, 4, 5], 0)
    connector.build_connector_meta(SchedulerOutput([]))
    assert request.block_hashes == hashes


def test_connector_works_with_prefix_caching_off(tiny_llama: Path, tmp_path):
    """The engine hashes prompts for the connector even when the prefix cache is off."""
    prompts = [[(7 * i + 3) % 380 + 2 for i in range(45)]]
    transfer = KVTransferConfig("SharedStorageConnector", "kv_both",
                                {"shared_storage_path": str(tmp_path)})

    def make(transfer_config):
        return LLM(str(tiny_llama), device="cpu", block_size=16, num_kv_blocks=64,
                   enable_prefix_caching=False, kv_transfer_config=transfer_config)

    expected = greedy_token_ids(make(None), prompts, 4)
    assert greedy_token_ids(make(transfer), prompts, 4) == expected  # stores 2 blocks
    consumer = make(transfer)
    assert greedy_token_ids(consumer, prompts, 4) == expected
    assert consumer.stats["prompt_tokens_external"] == 32
