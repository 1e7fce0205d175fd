"""NixlConnector's scheduler role on a model with windows, model-free: the per-group
reference a producer hands out, the claim a consumer makes from it and the blocks it
pairs or reports missing (rule 8 over P2P)."""

from __future__ import annotations

import pytest
from conftest import make_layout

from kvrecover import KVTransferConfig, SamplingParams
from kvrecover.kv_groups import build_kv_groups
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.p2p.nixl_connector import NixlConnector
from kvrecover.kv_transfer.p2p.params import RemoteReference, parse_reference
from kvrecover.kv_transfer.request_view import KVRequestView

# Block 4, layer 0 full attention, layer 1 a window of 8 tokens (2 blocks); a prompt of
# 41 tokens: 10 loadable blocks, the query at 40 reads blocks 8-9 of the window, a load
# ending there brings the window's blocks from 6 on (`first_loaded_block`).
LAYOUT = make_layout(groups=build_kv_groups([None, 8]))
PROMPT = tuple(range(41))
HASHES = tuple(bytes([i]) * 8 for i in range(10))
FULL = tuple(range(1, 11))


def connector(role: str) -> NixlConnector:
    return NixlConnector(KVTransferConfig("NixlConnector", role), KVConnectorRole.SCHEDULER,
                         LAYOUT)


def view(tables, computed: int = 0, params: dict | None = None) -> KVRequestView:
    sampling = SamplingParams()
    sampling.kv_transfer_params = params
    return KVRequestView("req", PROMPT, HASHES, computed, sampling,
                         tuple(tuple(t) for t in tables))


def reference(windowed: tuple[int, ...]) -> dict:
    return RemoteReference("producer", "req@1", (FULL, windowed), "127.0.0.1", 1, 1,
                           LAYOUT.fingerprint, grouped=True).as_params()


def test_a_producer_references_every_groups_blocks_and_only_a_windows_held_suffix():
    producer = connector("kv_producer")
    # The window released 0-5; a stray block at 2 below a null is not a held suffix.
    windowed = [0, 0, 50, 0, 0, 0, 21, 22, 23, 24, 25]
    assert producer.request_finished(view([FULL + (11,), windowed], computed=42), []) is True
    params = producer.kv_transfer_params(view([FULL, windowed]))
    assert params["remote_block_ids"] == [list(FULL), [0] * 6 + [21, 22, 23, 24]]
    assert parse_reference(params).group_block_ids == (FULL, (0,) * 6 + (21, 22, 23, 24))
    hold = next(iter(producer.build_connector_meta(None).holds.values()))
    assert hold[0][1] == (0,) * 6 + (21, 22, 23, 24) and len(hold[1]) == 10


@pytest.mark.parametrize("windowed, tokens, missing", [
    ((0,) * 6 + (26, 27, 28, 29), 40, []),  # the whole window and its margin held
    ((0,) * 8 + (28, 29), 40, [36, 37]),  # the margin released: invalid, not read
    ((0,) * 5 + (25, 26, 27, 0, 29), 32, []),  # block 8 lost: the claim ends at 8
], ids=["held", "margin-released", "window-hole"])
def test_a_consumer_claims_up_to_the_last_held_window_and_pairs_each_group(
        windowed, tokens, missing):
    consumer = connector("kv_consumer")
    params = reference(windowed)
    assert consumer.get_num_new_matched_tokens(view([], params=params), 0) == (tokens, False)
    end = tokens // 4
    local_windowed = [0] * 6 + [36, 37, 38, 39, 40]
    consumer.update_state_after_alloc(view([range(11, 22), local_windowed], params=params),
                                      [], tokens)
    (pull,) = consumer.build_connector_meta(None).pulls
    start = LAYOUT.kv_groups[1].first_loaded_block(tokens, 4)
    expected = [(11 + p, FULL[p], (0, p)) for p in range(end)] + [
        (local_windowed[p], windowed[p], (1, p)) for p in range(start, end) if windowed[p] and local_windowed[p]]
    assert sorted(zip(pull.block_ids, pull.remote_block_ids, pull.remote_slots)) == \
        sorted(expected)
    assert pull.missing == missing and pull.last_position == end - 1


def test_a_reference_of_another_group_count_claims_nothing():
    consumer = connector("kv_consumer")
    params = reference((0,) * 6 + (26, 27, 28, 29))
    params["remote_block_ids"] = list(FULL)  # the one-group form on a model with windows
    assert consumer.get_num_new_matched_tokens(view([], params=params), 0) == (0, False)


@pytest.mark.parametrize("block_ids", [
    [[1, 2], [3]], [[1, 2], [0, -1]], [[1, 2], ["x", 3]], [], [[]], [1, 0]],
    ids=["lengths", "negative", "type", "empty", "empty-group", "flat-null"])
def test_malformed_group_lists_are_refused_naming_the_field(block_ids):
    params = reference((0,) * 6 + (26, 27, 28, 29))
    params["remote_block_ids"] = block_ids
    with pytest.raises(ValueError, match="remote_block_ids"):
        parse_reference(params)
