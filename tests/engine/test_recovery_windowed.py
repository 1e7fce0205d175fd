"""Recovery on sliding-window models (rule 8), end to end on tiny checkpoints.

Four layouts: every layer windowed (Mistral: one windowed KV cache group), mixed
(the same checkpoint with its middle layer on full attention: three groups, one of
them full), Gemma 3 (three local layers and one global: four groups) and gpt-oss
(windowed, full, windowed, with attention sinks and experts: three groups). A load brings each windowed group's last window before the resume point
and one window more; the fault injector fails a chosen group's loaded blocks. Every
recovered run returns exactly the failure-free token ids, and the tokens recomputed
(`kv_load_recomputed_tokens`) are exactly where rule 8 puts the rollback point:
nothing for a lost block no window reads again, back to its own start for one
inside the last window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import build_tiny_model
from test_recovery import PARAMS, as_inputs, make_prompts, token_ids

from kvrecover import LLM, KVTransferConfig
from kvrecover.kv_transfer.base import KVConnectorBase
from kvrecover.models.mistral import MistralConfig

WINDOW = 24
BLOCK = 8
# make_prompts()[0] has 130 tokens: 16 loadable blocks, loads end at 128. A windowed
# group's last window (keys >= 105) is blocks 13..15, its margin blocks 10..12.
LOADED_WINDOWED = list(range(10, 16))


def mixed_windows(self) -> list[int | None]:
    """Layer 1 on full attention, the others windowed: groups full(1), w(0), w(2)."""
    return [None if i == 1 else self.sliding_window for i in range(self.num_hidden_layers)]


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("mistral_w"), model_type="mistral",
                            seed=7, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def tiny_mistral_full(tmp_path_factory) -> Path:
    """The same shape without a window (full attention)."""
    return build_tiny_model(tmp_path_factory.mktemp("mistral_f"), model_type="mistral",
                            seed=7, sliding_window=None)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> Path:
    """Gemma 3 (text): layers 0, 1, 3 local (window 24), layer 2 global."""
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    return build_tiny_model(
        tmp_path_factory.mktemp("gemma3_w"), model_type="gemma3_text", seed=13,
        sliding_window=WINDOW, head_dim=16, num_hidden_layers=4, layer_types=types,
        query_pre_attn_scalar=24, rope_local_base_freq=500.0, tie_word_embeddings=True)


@pytest.fixture(scope="module", params=["windowed", "mixed", "gemma3", "gpt_oss"])
def layout(request):
    """The layer pattern: 'windowed' (Mistral), 'mixed' (Mistral with layer 1 on full
    attention), 'gemma3' or 'gpt_oss' (conftest's tiny_gpt_oss: window 24 as here)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "mixed":
            patch.setattr(MistralConfig, "layer_windows", mixed_windows)
        yield request.param


@pytest.fixture(scope="module")
def model(layout, request) -> Path:
    """The checkpoint of the layout."""
    names = {"gemma3": "tiny_gemma3", "gpt_oss": "tiny_gpt_oss"}
    return request.getfixturevalue(names.get(layout, "tiny_mistral"))


NUM_GROUPS = {"windowed": 1, "mixed": 3, "gemma3": 4, "gpt_oss": 3}
LOCAL_LAYERS = {"gemma3": 3, "gpt_oss": 2}  # models of one global layer


def engine(model: Path, kv: KVTransferConfig | None = None, **extra) -> LLM:
    return LLM(str(model), device="cpu", block_size=BLOCK, max_num_batched_tokens=32,
               kv_transfer_config=kv, **extra)


@pytest.fixture(scope="module")
def stored(layout, model, tmp_path_factory):
    """(store filled by a producer, failure-free token ids) for this layout."""
    store = tmp_path_factory.mktemp(f"store_{layout}")
    producer = KVTransferConfig("SharedStorageConnector", "kv_producer",
                                {"shared_storage_path": str(store)})
    engine(model, producer).generate(as_inputs(make_prompts()), PARAMS)
    baseline = token_ids(engine(model).generate(as_inputs(make_prompts()), PARAMS))
    return store, baseline


def decode(model: Path, store: Path, faults=None, *, async_load=False, policy="recompute"):
    extra = {"shared_storage_path": str(store), "async_load": async_load,
             "load_timeout_s": 5.0, "faults": faults or []}
    # No second attempt (rule 6): a faulted request stays broken, and the counters below
    # are those of one verdict.
    transfer = KVTransferConfig("FaultInjectionConnector", "kv_consumer", extra,
                                kv_load_failure_policy=policy, kv_load_retry_limit=0)
    llm = engine(model, transfer)
    return llm.generate(as_inputs(make_prompts()), PARAMS), llm


def windowed_group(layout: str) -> int:
    return 0 if layout == "windowed" else 1  # else: the full-attention group is 0


def test_a_clean_load_matches_and_moves_less_than_full_attention(
        layout, model, tiny_mistral_full, stored, tmp_path):
    store, baseline = stored
    outputs, llm = decode(model, store)
    assert token_ids(outputs) == baseline
    assert llm.stats["kv_load_failed_blocks"] == 0
    assert llm.stats["prompt_tokens_external"] == sum(
        (len(p) - 1) // BLOCK * BLOCK for p in make_prompts())
    if layout in LOCAL_LAYERS:
        # One layer per group: the global one loads 45 blocks, each local one 24.
        local, layer_block = LOCAL_LAYERS[layout], llm.engine.layout.block_nbytes
        assert (llm.stats["kv_load_bytes"] == (45 + local * 24) * layer_block
                < (1 + local) * 45 * layer_block)
        return
    # The same loads on a full-attention model of the same shape move more bytes.
    full_store = tmp_path / "full"
    producer = KVTransferConfig("SharedStorageConnector", "kv_producer",
                                {"shared_storage_path": str(full_store)})
    engine(tiny_mistral_full, producer).generate(as_inputs(make_prompts()), PARAMS)
    _, full = decode(tiny_mistral_full, full_store)
    assert full.stats["prompt_tokens_external"] == llm.stats["prompt_tokens_external"]
    # Full attention loads 16 + 15 + 7 + 7 = 45 blocks of 3 layers; a windowed group 6
    # per request (its last window and margin), 24 blocks. Mixed: groups of one layer,
    # the full one 45 blocks and the two windowed ones 24 each.
    full_bytes = full.stats["kv_load_bytes"]
    layer_block = full_bytes // (45 * 3)
    expected = 24 * 3 if layout == "windowed" else 45 + 2 * 24
    assert llm.stats["kv_load_bytes"] == expected * layer_block < full_bytes


# (blocks of the group's loaded ones, in the windowed group or the full one) -> the
# first request's rollback point; it had computed 130 tokens (sync: the load step also
# ran the last two prompt tokens) or 128 (async: judged when the load ends).
CASES = {
    # The first loaded windowed block (10) is margin: no window reads it again.
    ("first", "windowed"): None,
    # Block 15 is in the last window: back to its start, whose window (97..119) is held.
    ("last", "windowed"): 120,
    # Block 13 (104..111): back to 104, whose window reads blocks 10..12 (the margin).
    ("middle", "windowed"): 104,
    # The full group's first loaded block is block 0: nothing before it is valid.
    ("first", "full"): 0,
    ("last", "full"): 120,
}


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["missing", "error", "corrupt"])
@pytest.mark.parametrize("case", list(CASES), ids=["-".join(c) for c in CASES])
def test_recompute_matrix_rolls_back_exactly_to_rule_8s_point(
        layout, model, stored, case, kind, async_load):
    blocks, kind_of_group = case
    if kind_of_group == "full" and layout == "windowed":
        pytest.skip("this layout has no full-attention group")
    store, baseline = stored
    group = 0 if kind_of_group == "full" else windowed_group(layout)
    faults = [{"requests": "first", "blocks": blocks, "kind": kind, "group": group}]
    outputs, llm = decode(model, store, faults, async_load=async_load)
    assert token_ids(outputs) == baseline
    stats = llm.stats
    assert stats["kv_load_failed_blocks"] == 1
    assert stats["kv_load_failed_requests"] == 0
    computed = 128 if async_load else 130
    rollback = CASES[case]
    expected = 0 if rollback is None else computed - rollback
    assert stats["kv_load_recomputed_tokens"] == expected


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_fail_policy_ends_only_a_request_whose_window_lost_a_block(
        layout, model, stored, async_load):
    store, baseline = stored
    group = windowed_group(layout)
    lost = [{"requests": "first", "blocks": "last", "kind": "missing", "group": group}]
    outputs, llm = decode(model, store, lost, async_load=async_load, policy="fail")
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[0].error_type == "kv_load_failed"
    assert token_ids(outputs)[1:] == baseline[1:]
    assert llm.stats["kv_load_failed_requests"] == 1
    # A lost margin block costs nothing, under `fail` too.
    margin = [{"requests": "first", "blocks": "first", "kind": "missing", "group": group}]
    outputs, llm = decode(model, store, margin, async_load=async_load, policy="fail")
    assert token_ids(outputs) == baseline
    assert llm.stats["kv_load_failed_requests"] == 0
    assert llm.stats["kv_load_failed_blocks"] == 1


def test_every_block_of_every_request_failing_recomputes_everything(layout, model, stored):
    store, baseline = stored
    faults = [{"requests": "all", "blocks": "all", "kind": "missing", "group": g}
              for g in range(NUM_GROUPS[layout])]
    outputs, llm = decode(model, store, faults)
    assert token_ids(outputs) == baseline
    assert llm.stats["kv_load_recovered_requests"] >= 4


def test_a_long_request_holds_a_bounded_number_of_window_blocks(layout, model):
    llm = engine(model, num_kv_blocks=400)
    prompt = make_prompts()[0] * 3  # 390 tokens
    llm.engine.add_request("long", {"prompt_token_ids": prompt}, PARAMS)
    scheduler = llm.engine.scheduler
    request = scheduler.requests["long"]
    windowed = [g for g, group in enumerate(scheduler.kv_manager.groups)
                if group.window is not None]
    most = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        if request.is_finished:
            break
        held = scheduler.kv_manager.blocks_held(request)
        most = max(most, *(held[g] for g in windowed))
    # Chunks of 32 over a window of 24: (24 + 32) / 8 + 1 blocks; 49 with full attention.
    assert 0 < most <= 8
    assert len(request.output_token_ids) == PARAMS.max_tokens


class NoGroupsConnector(KVConnectorBase):
    """A user's connector that knows nothing of KV cache groups."""


def test_a_connector_without_groups_is_refused_at_start_up(layout, model):
    transfer = KVTransferConfig("NoGroupsConnector", "kv_both",
                                kv_connector_module_path=__name__)
    with pytest.raises(ValueError, match="NoGroupsConnector.*does not support KV cache groups"):
        engine(model, transfer)


def store_settings(connector: str, url: str, folder: Path) -> dict:
    """The extra config of a Redis store or of tiers (a folder, then Redis)."""
    if connector == "RedisConnector":
        return {"url": url}
    return {"connectors": [
        {"kv_connector": "SharedStorageConnector",
         "kv_connector_extra_config": {"shared_storage_path": str(folder)}},
        {"kv_connector": "RedisConnector", "kv_connector_extra_config": {"url": url}},
    ]}


@pytest.mark.parametrize("connector", ["RedisConnector", "TieredConnector"])
def test_redis_and_tiers_work_per_group(layout, model, stored, redis_server, tmp_path,
                                        connector):
    if layout != "gemma3":
        pytest.skip("one multi-group layout is enough for these stores")
    _, baseline = stored
    settings = store_settings(connector, redis_server.url, tmp_path / "tier0")
    engine(model, KVTransferConfig(connector, "kv_producer", settings)).generate(
        as_inputs(make_prompts()), PARAMS)
    faults = [{"requests": "first", "blocks": "last", "kind": "corrupt", "group": 1}]
    consumer = KVTransferConfig(
        "FaultInjectionConnector", "kv_consumer",
        {"inner_connector": connector, "faults": faults, **settings}, kv_load_retry_limit=0)
    llm = engine(model, consumer)
    assert token_ids(llm.generate(as_inputs(make_prompts()), PARAMS)) == baseline
    assert llm.stats["kv_load_failed_blocks"] == 1
    assert llm.stats["kv_load_recomputed_tokens"] == 130 - 120  # rule 8's point, as above
    assert llm.stats["prompt_tokens_external"] > 0
