"""Two and three faults at once, on every layer pattern (rule 8), sync and async.

A fault is a stored entry that is not there (a group's entry of one block deleted from
the folder: every request's claim stops before it) or a read that fails (missing, error
or corrupt, injected into any group's loaded blocks of the first request). With a
sync load the step that loads also computes the tokens after the claim, and those read
the loaded blocks through each window: a bad block there makes everything computed on
top of it invalid, even where the final window no longer reads it.

Property: under policy "recompute" the token ids are those of a run without a
connector; under "fail" exactly the requests whose recovery had to recompute end with
an error (here only the first request is ever faulted) and every other one is exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import WINDOWED_CHECKPOINTS, build_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_recovery import PARAMS, as_inputs, make_prompts, token_ids

from kvrecover import LLM, KVTransferConfig
from kvrecover.kv_layout import group_block_key, update_block_hashes
from kvrecover.kv_transfer.stores.block_store import SUFFIX

BLOCK = 8
# make_prompts()[0] has 130 tokens: 16 loadable blocks; a windowed group loads 6 of them.
NUM_PROMPT_BLOCKS = 16

LAYOUTS = {"llama": dict(model_type="llama", seed=3), **WINDOWED_CHECKPOINTS}


def engine(model: Path, kv: KVTransferConfig | None = None) -> LLM:
    return LLM(str(model), device="cpu", block_size=BLOCK, max_num_batched_tokens=32,
               kv_transfer_config=kv)


@pytest.fixture(scope="module", params=[*LAYOUTS, "gpt_oss"])
def stored(request, tmp_path_factory):
    """(model, store filled by a producer, each KV cache group's window, baseline ids)."""
    name = request.param
    if name == "gpt_oss":
        model = request.getfixturevalue("tiny_gpt_oss")  # window 24 too
    else:
        model = build_tiny_model(tmp_path_factory.mktemp(name), **LAYOUTS[name])
    store = tmp_path_factory.mktemp(f"store_{name}")
    producer = KVTransferConfig("SharedStorageConnector", "kv_producer",
                                {"shared_storage_path": str(store)})
    engine(model, producer).generate(as_inputs(make_prompts()), PARAMS)
    clean = engine(model)
    baseline = token_ids(clean.generate(as_inputs(make_prompts()), PARAMS))
    windows = [group.window for group in clean.engine.layout.kv_groups]
    return model, store, windows, baseline


def store_without(store: Path, work: Path, absent: list[tuple[int, int]]) -> Path:
    """A copy of `store` lacking group g's entry of the first prompt's block k, for each
    (k, g) in `absent`."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(store, work)
    hashes: list[bytes] = []
    update_block_hashes(hashes, make_prompts()[0], BLOCK)
    for block, group in absent:
        name = group_block_key(hashes[block], group).hex() + SUFFIX
        for path in work.rglob(name):
            path.unlink()
    return work


def decode(model: Path, store: Path, faults: list[dict], async_load: bool, policy: str):
    extra = {"shared_storage_path": str(store), "async_load": async_load,
             "load_timeout_s": 5.0, "faults": faults}
    # No second attempt (rule 6): a faulted request stays broken, one verdict each.
    transfer = KVTransferConfig("FaultInjectionConnector", "kv_consumer", extra,
                                kv_load_failure_policy=policy, kv_load_retry_limit=0)
    llm = engine(model, transfer)
    return llm.generate(as_inputs(make_prompts()), PARAMS), llm.stats


def check_both_policies(stored, tmp_path: Path, absent: list[tuple[int, int]],
                        faults: list[dict], async_load: bool) -> int:
    """Run the faults under both policies, check the property; returns the tokens the
    "recompute" run recomputed."""
    model, store, _, baseline = stored
    source = store_without(store, tmp_path / "store", absent) if absent else store
    outputs, stats = decode(model, source, faults, async_load, "recompute")
    assert token_ids(outputs) == baseline, (absent, faults, async_load)
    assert stats["kv_load_failed_requests"] == 0
    recomputed = stats["kv_load_recomputed_tokens"]
    outputs, stats = decode(model, source, faults, async_load, "fail")
    first = outputs[0]
    assert (first.outputs[0].finish_reason == "error") == (recomputed > 0), (
        absent, faults, async_load, recomputed)
    if recomputed:
        assert first.error_type == "kv_load_failed"
        assert stats["kv_load_failed_requests"] == 1
    else:
        assert first.outputs[0].token_ids == baseline[0]
    assert token_ids(outputs)[1:] == baseline[1:]
    assert all(o.outputs[0].finish_reason != "error" for o in outputs[1:])
    return recomputed


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_missing_entry_after_a_corrupt_window_block_recomputes(stored, tmp_path, async_load):
    """The case that returned wrong tokens: block 15 is not stored, so the sync step
    computes tokens 120..129 on top of the load; their windows read block 12, which is
    corrupt, although the window at 130 starts in block 13."""
    _, _, windows, _ = stored
    for group, window in enumerate(windows):
        # Of the load ending at 120, a windowed group's loaded blocks are 9..14 (position
        # 3 is block 12); a full group's are 0..14.
        position = 12 if window is None else 3
        faults = [{"requests": "first", "blocks": [position], "kind": "corrupt",
                   "group": group}]
        recomputed = check_both_policies(stored, tmp_path, [(15, 0)], faults, async_load)
        assert recomputed > 0


fault_kinds = st.sampled_from(["missing", "error", "corrupt"])


@st.composite
def fault_plans(draw, num_groups: int):
    """0-2 absent stored entries and 0-3 failing reads, at least two faults in all."""
    absent = draw(st.lists(st.tuples(st.integers(1, NUM_PROMPT_BLOCKS - 1),
                                      st.integers(0, num_groups - 1)), max_size=2))
    reads = draw(st.lists(
        st.fixed_dictionaries({"requests": st.just("first"),
                               "blocks": st.lists(st.integers(0, 15), min_size=1, max_size=2),
                               "kind": fault_kinds,
                               "group": st.integers(0, num_groups - 1)}),
        min_size=max(0, 2 - len(absent)), max_size=3))
    return absent, reads


@pytest.mark.slow
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_any_two_or_three_faults_keep_the_output_exact(stored, tmp_path, async_load):
    num_groups = len(stored[2])

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow,
                                     HealthCheck.function_scoped_fixture])
    @given(fault_plans(num_groups))
    def property_holds(plan):
        absent, reads = plan
        check_both_policies(stored, tmp_path, absent, reads, async_load)

    property_holds()
