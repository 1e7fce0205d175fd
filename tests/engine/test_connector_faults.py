"""Connectors that misbehave (issue 15 items 3, 4, 6, 7), end to end on a tiny model.

A connector that never finishes a load, raises in any method, answers garbage or
lies about what it can load must never crash, hang or change an output: under
policy `recompute` every run returns exactly the no-connector baseline; under
`fail` only the requests it touched end with `kv_load_failed`. The connectors
below are loaded by module path from this file, as a user's own would be.
"""

from __future__ import annotations

import logging

import pytest
from test_recovery import PARAMS, as_inputs, decode, fill_store, make_prompts, token_ids

from kvrecover import LLM, KVTransferConfig
from kvrecover.kv_layout import blocks_needed
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector

TIMEOUT_S = 0.5  # every async load's deadline here: tests end by design, not by timeout


@pytest.fixture(scope="module")
def stored(tiny_llama, tmp_path_factory):
    """(model, store filled by a producer, no-connector baseline token ids)."""
    return fill_store(tiny_llama, tmp_path_factory.mktemp("store"))


# ----- connectors ---------------------------------------------------------------------------
class NeverFinishes(SharedStorageConnector):
    """Starts async loads and never reports one finished, not even when cancelled."""

    def get_finished(self, finished_req_ids):
        return None, None


class FinishesOnlyWhenCancelled(SharedStorageConnector):
    """Never completes a load on its own; confirms the ones the engine gave up on."""

    def get_finished(self, finished_req_ids):
        cancelled = set(finished_req_ids) & set(self._async_loads)
        for request_id in cancelled:
            self._async_loads.pop(request_id).cancelled.set()
        return None, cancelled or None


class Misbehaves(SharedStorageConnector):
    """Does its real work, then breaks the contract in `method` (set by subclasses)."""

    method = ""

    def _break(self, name, result):
        if name != self.method:
            return result
        raise RuntimeError(f"{name} exploded")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._break("get_num_new_matched_tokens",
                           super().get_num_new_matched_tokens(request, num_computed_tokens))

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        self._break("update_state_after_alloc", None)

    def build_connector_meta(self, scheduler_output):
        return self._break("build_connector_meta", super().build_connector_meta(scheduler_output))

    def request_finished(self, request, block_ids):
        return self._break("request_finished", super().request_finished(request, block_ids))

    def bind_connector_metadata(self, metadata):
        super().bind_connector_metadata(metadata)
        self._break("bind_connector_metadata", None)

    def start_load_kv(self, kv_caches):
        super().start_load_kv(kv_caches)
        self._break("start_load_kv", None)

    def wait_for_layer_load(self, layer_index):
        self._break("wait_for_layer_load", None)

    def get_finished(self, finished_req_ids):
        return self._break("get_finished", super().get_finished(finished_req_ids))


SCHEDULER_SIDE = ["get_num_new_matched_tokens", "update_state_after_alloc",
                  "build_connector_meta", "request_finished"]
WORKER_SIDE = ["bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "get_finished"]
for _method in SCHEDULER_SIDE + WORKER_SIDE:
    globals()[f"Breaks_{_method}"] = type(f"Breaks_{_method}", (Misbehaves,), {"method": _method})


GARBAGE_REPORTS = {
    "strings": ["x"], "floats": {1.5}, "bools": {True}, "negative": {-1},
    "out-of-range": {10**9}, "not-iterable": 5, "a-string": "12", "none": None,
}


class GarbageErrorReport(SharedStorageConnector):
    """Loads correctly, but reports `garbage` as its failed blocks whenever a load ends."""

    garbage: object = None

    def get_block_ids_with_load_errors(self):
        real = super().get_block_ids_with_load_errors()
        return self.garbage if (real or self._ended) else real

    def start_load_kv(self, kv_caches):
        super().start_load_kv(kv_caches)
        self._ended = bool([t for t in self._get_connector_metadata().loads if not t.is_async])

    def get_finished(self, finished_req_ids):
        sending, recving = super().get_finished(finished_req_ids)
        self._ended = getattr(self, "_ended", False) or bool(recving)
        return sending, recving

    def clear_connector_metadata(self):
        super().clear_connector_metadata()
        self._ended = False


for _name, _value in GARBAGE_REPORTS.items():
    _class_name = "Garbage_" + _name.replace("-", "_")
    globals()[_class_name] = type(_class_name, (GarbageErrorReport,), {"garbage": _value})


class GarbageFinished(SharedStorageConnector):
    """Reports finished loads as `garbage(real)` instead of a set of request ids."""

    @staticmethod
    def garbage(real):
        return real

    def get_finished(self, finished_req_ids):
        sending, recving = super().get_finished(finished_req_ids)
        return sending, self.garbage(recving)


class FinishedAsInts(GarbageFinished):
    garbage = staticmethod(lambda real: {hash(r) for r in real} if real else real)


class FinishedAsAString(GarbageFinished):
    garbage = staticmethod(lambda real: ",".join(sorted(real)) if real else real)


class Claims(SharedStorageConnector):
    """Claims `claim(real, request)` tokens instead of what it really has."""

    @staticmethod
    def claim(real, request):
        return real

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        real, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return self.claim(real, request), self.async_load


class ClaimsTheWorld(Claims):
    claim = staticmethod(lambda real, request: 10**9)


class ClaimsUnaligned(Claims):
    claim = staticmethod(lambda real, request: real + 5 if real else 0)


class ClaimsNegative(Claims):
    claim = staticmethod(lambda real, request: -3)


class ClaimsAString(Claims):
    claim = staticmethod(lambda real, request: str(real))


class ClaimsTheWholePrompt(Claims):
    claim = staticmethod(lambda real, request: request.num_prompt_tokens)


def run(stored, connector: str, *, async_load: bool, policy: str = "recompute",
        load_timeout_s: float = TIMEOUT_S, **kwargs):
    model, store, _ = stored
    return decode(model, store, async_load=async_load, policy=policy, connector=connector,
                  module_path=__file__, load_timeout_s=load_timeout_s, **kwargs)


# ----- item 4: the engine's own deadline ----------------------------------------------------
@pytest.mark.parametrize("connector", ["NeverFinishes", "FinishesOnlyWhenCancelled"])
def test_a_load_never_reported_finished_ends_at_the_engines_deadline(stored, connector):
    outputs, llm = run(stored, connector, async_load=True)
    assert token_ids(outputs) == stored[2]
    stats = llm.stats
    assert stats["kv_load_recovered_requests"] == 4 and stats["kv_load_failed_blocks"] > 0
    assert stats["prompt_tokens_external"] == 0
    scheduler = llm.engine.scheduler
    pool = scheduler.kv_manager.pool
    if connector == "NeverFinishes":  # its blocks stay held: it may still write them
        assert len(scheduler.loads.orphans) == 4
        held = sum(len(o.block_ids) for o in scheduler.loads.orphans.values())
        assert pool.num_free_blocks == pool.num_usable_blocks - held > 0
    else:  # cancelled and confirmed: every block is back
        assert not scheduler.loads.orphans
        assert pool.num_free_blocks == pool.num_usable_blocks
    # The same LLM keeps working (its leftovers never block a later generate).
    assert token_ids(llm.generate(as_inputs(make_prompts()), PARAMS)) == stored[2]


def test_a_never_finished_load_under_policy_fail_is_an_error(stored):
    outputs, llm = run(stored, "NeverFinishes", async_load=True, policy="fail")
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"] * 4
    assert all(o.error_type == "kv_load_failed" and "deadline" in o.error for o in outputs)
    assert llm.stats["kv_load_failed_requests"] == 4


# ----- item 6: connector exceptions ----------------------------------------------------------
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("method", SCHEDULER_SIDE + WORKER_SIDE)
def test_a_raising_connector_method_never_escapes_generate(stored, method, async_load, caplog):
    with caplog.at_level(logging.ERROR, "kvrecover"):
        outputs, llm = run(stored, f"Breaks_{method}", async_load=async_load)
    assert token_ids(outputs) == stored[2]
    assert llm.stats["kv_connector_errors"] >= 1
    logged = [r for r in caplog.records if method in r.getMessage()]
    assert len(logged) == 1  # once per kind, however often it raised
    # A failure while loads are under way makes them failures; an async load is never
    # waited for layer by layer, so there `wait_for_layer_load` touches no load.
    touches_loads = ["update_state_after_alloc", "build_connector_meta",
                     "bind_connector_metadata", "start_load_kv"]
    if method in touches_loads or (method == "wait_for_layer_load" and not async_load):
        assert llm.stats["kv_load_recovered_requests"] >= 1


@pytest.mark.parametrize("method", ["get_num_new_matched_tokens", "update_state_after_alloc",
                                    "start_load_kv"])
def test_a_raising_connector_under_policy_fail_fails_only_what_it_touched(stored, method):
    outputs, llm = run(stored, f"Breaks_{method}", async_load=False, policy="fail")
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"] * 4
    assert all(o.error_type == "kv_load_failed" for o in outputs)
    # A request the connector has nothing for is untouched by a failing load.
    outputs, _ = run(stored, f"Breaks_{method}", async_load=False, policy="fail",
                     prompts=[[5, 6, 7, 8, 9] * 7])
    expected = "error" if method == "get_num_new_matched_tokens" else "length"
    assert outputs[0].outputs[0].finish_reason == expected


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("garbage", list(GARBAGE_REPORTS))
def test_a_garbage_error_report_fails_the_loads_that_ended(stored, garbage, async_load):
    connector = "Garbage_" + garbage.replace("-", "_")
    outputs, llm = run(stored, connector, async_load=async_load)
    assert token_ids(outputs) == stored[2]
    stats = llm.stats
    assert stats["kv_connector_errors"] >= 1 and stats["kv_load_failed_blocks"] > 0
    assert stats["kv_load_recovered_requests"] >= 1


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("connector", ["FinishedAsInts", "FinishedAsAString"])
def test_a_garbage_finished_report_is_contained(stored, connector, async_load):
    outputs, llm = run(stored, connector, async_load=async_load)
    assert token_ids(outputs) == stored[2]
    if async_load:  # never confirmed: the engine's deadline ended every load
        assert llm.stats["kv_connector_errors"] >= 1
        assert llm.stats["kv_load_recovered_requests"] == 4
    else:  # get_finished has nothing to report for sync loads
        assert llm.stats["kv_connector_errors"] == 0


# ----- item 7: lying claims --------------------------------------------------------------------
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("connector", ["ClaimsTheWorld", "ClaimsUnaligned", "ClaimsNegative",
                                       "ClaimsAString", "ClaimsTheWholePrompt"])
def test_a_lying_claim_never_changes_an_output(stored, connector, async_load):
    # A generous deadline: a slow machine must not turn a good load into a failed one.
    outputs, llm = run(stored, connector, async_load=async_load, retry_limit=0,
                       load_timeout_s=30.0)
    assert token_ids(outputs) == stored[2]
    stats = llm.stats
    assert stats["kv_connector_errors"] >= 1
    assert stats["prompt_tokens_external"] % 16 == 0  # whole blocks only
    if connector in ("ClaimsNegative", "ClaimsAString"):
        assert stats["prompt_tokens_external"] == 0  # a bad claim is a miss
    if connector == "ClaimsUnaligned":  # rounded down: exactly what is stored still loads
        assert stats["prompt_tokens_external"] > 0 and stats["kv_load_failed_blocks"] == 0


# ----- item 3: small caches -------------------------------------------------------------------
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("num_kv_blocks", [11, 12, 14])
@pytest.mark.parametrize("faults", [None, [{"requests": "all", "blocks": "middle",
                                            "kind": "missing"}]], ids=["clean", "faulty"])
def test_small_caches_degrade_to_slower_never_to_an_error(stored, num_kv_blocks, async_load,
                                                         faults):
    model, store, baseline = stored
    # Tight: the four requests need 28 blocks at their longest, the longest one 9.
    assert sum(blocks_needed(len(p) + PARAMS.max_tokens, 16) for p in make_prompts()) == 28
    connector = "FaultInjectionConnector" if faults else "SharedStorageConnector"
    outputs, llm = decode(model, store, async_load=async_load, faults=faults, connector=connector,
                          num_kv_blocks=num_kv_blocks, max_num_batched_tokens=16)
    assert token_ids(outputs) == baseline
    pool = llm.engine.scheduler.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_a_small_cache_with_async_loads_across_generate_calls(stored):
    """The same LLM, one prompt per call and then all at once, on a 10-block cache."""
    model, store, baseline = stored
    transfer = KVTransferConfig("SharedStorageConnector", "kv_consumer",
                                {"shared_storage_path": str(store), "async_load": True})
    llm = LLM(str(model), device="cpu", kv_transfer_config=transfer, num_kv_blocks=11,
              max_num_batched_tokens=16)
    prompts = as_inputs(make_prompts())
    singles = [token_ids(llm.generate([p], PARAMS))[0] for p in prompts]
    assert singles == baseline
    assert token_ids(llm.generate(prompts, PARAMS)) == baseline
