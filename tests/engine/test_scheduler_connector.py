"""The scheduler's guarded view of a connector (engine/scheduler_connector.py), no model.

Issue 15: claims from `get_num_new_matched_tokens` are validated (item 7), and a
scheduler-side connector exception or a garbled worker report is a KV failure of
the requests it touches, handled by the policy and logged once (item 6).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from scheduler_harness import (
    BLOCK,
    PROMPT,
    TOKEN,
    FakeClock,
    FakeConnector,
    add,
    all_blocks_free,
    make_scheduler,
    run_to_completion,
    slice_of,
    step,
)

from kvrecover.engine.request import RequestStatus
from kvrecover.kv_layout import update_block_hashes
from kvrecover.kv_transfer.request_view import KVRequestView


# ----- issue 15 item 7: claims are validated ------------------------------------------------
@pytest.mark.parametrize("claim, accepted", [
    (20, 20), (16, 16), (10**9, 20), (19, 16), (7, 4), (3, 0), (-5, 0), (2.5, 0), ("8", 0),
    (True, 0), (None, 0),
])
def test_claims_are_capped_block_aligned_and_the_rest_computed(claim, accepted):
    connector = FakeConnector({"a": [(claim, False)]})
    scheduler = make_scheduler(connector)
    a = add(scheduler, "a", PROMPT)
    output, _ = step(scheduler)
    assert connector.allocs[0][2] == accepted
    computed = slice_of(output, "a")
    assert computed.num_computed_tokens == accepted
    assert computed.token_ids == PROMPT[accepted:]
    assert a.output_token_ids == [TOKEN]
    assert scheduler.stats.prompt_tokens_external == accepted
    assert scheduler.stats.kv_connector_errors == (0 if accepted == claim else 1)


def test_claims_respect_local_hits():
    connector = FakeConnector({"b": [(10**9, False)]})
    scheduler = make_scheduler(connector)
    add(scheduler, "a", PROMPT[:9])
    step(scheduler)
    add(scheduler, "b", PROMPT)
    output, _ = step(scheduler)
    assert connector.lookups_of("b") == [8]
    assert connector.allocs[-1][2] == 12  # 8 local + 12 external = 20, the last token local
    assert slice_of(output, "b").num_computed_tokens == 20


# ----- issue 15 item 6: connector exceptions are KV failures of whom they touch -------------
SCHEDULER_METHODS = ["get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished"]


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("method", SCHEDULER_METHODS)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_scheduler_side_connector_exceptions_are_contained(method, async_load, policy, caplog):
    clock = FakeClock()
    connector = FakeConnector({"a": [(20, async_load)], "b": [(4, async_load)]}, {method})
    scheduler = make_scheduler(connector, policy=policy, clock=clock)
    a = add(scheduler, "a", PROMPT)
    b = add(scheduler, "b", list(range(200, 209)))
    c = add(scheduler, "c", list(range(300, 309)))  # no KV offered, yet the connector runs
    with caplog.at_level(logging.DEBUG, "kvrecover"):
        for _ in range(100):
            if not scheduler.has_unfinished():
                break
            # The worker reports the loads it got; loads it never got never finish.
            clock.now += 1.0
            step(scheduler, finished_recving={
                r.request_id for r in (a, b)
                if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
                and method not in ("update_state_after_alloc", "build_connector_meta")
            })
    assert not scheduler.has_unfinished()
    touched_fail = policy == "fail" and method != "request_finished"
    for request in (a, b):
        if touched_fail:
            assert request.status is RequestStatus.FINISHED_ERROR
            assert request.error_type == "kv_load_failed"
        else:
            assert request.output_token_ids == [TOKEN] * 3
    if method == "get_num_new_matched_tokens" and policy == "fail":
        assert c.status is RequestStatus.FINISHED_ERROR  # its lookup failed too
    else:
        assert c.output_token_ids == [TOKEN] * 3
    assert scheduler.stats.kv_connector_errors >= 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and method in r.getMessage()]
    assert len(errors) == 1  # logged once per kind
    never_started = method in ("update_state_after_alloc", "build_connector_meta")
    if async_load and never_started:  # expired: held until the worker confirms
        assert set(scheduler.loads.orphans) == {"a", "b"} and not all_blocks_free(scheduler)
    else:
        assert not scheduler.loads.orphans and all_blocks_free(scheduler)


@pytest.mark.parametrize("answer", [None, 5, (1, 2, 3), ("x", "y"), (4, "maybe")])
def test_a_malformed_lookup_answer_is_a_connector_error(answer):
    connector = FakeConnector({"a": [answer]})
    scheduler = make_scheduler(connector)
    a = add(scheduler, "a", PROMPT)
    run_to_completion(scheduler)
    assert a.output_token_ids == [TOKEN] * 3
    assert scheduler.stats.kv_connector_errors == 1
    assert scheduler.stats.prompt_tokens_external == 0


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_an_unusable_load_report_fails_every_load_that_ended(async_load):
    connector = FakeConnector({"a": [(20, async_load), (0, False)]})
    scheduler = make_scheduler(connector)
    a = add(scheduler, "a", PROMPT)
    b = add(scheduler, "b", list(range(200, 209)))
    if async_load:
        step(scheduler)
    step(scheduler, finished_recving={"a"} if async_load else (), kv_load_report_failed=True)
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    assert scheduler.stats.kv_load_failed_blocks == 5
    run_to_completion(scheduler)
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 3
    assert scheduler.stats.prompt_tokens_external == 0


@pytest.mark.parametrize("value, deadline", [
    (2.5, 2.5), (7, 7.0), (float("inf"), 30.0), (0, 30.0), (-1, 30.0), ("soon", 30.0),
    (None, 30.0), (True, 30.0),
])
def test_the_engine_deadline_is_the_connectors_when_usable(value, deadline):
    connector = FakeConnector()
    connector.load_timeout_s = value
    assert make_scheduler(connector).loads.timeout_s == deadline


# ----- a connector's own counters (get_connector_stats) -------------------------------------
class CountingConnector(FakeConnector):
    """Reports its own counters each step: `answers` in turn (the last one repeats)."""

    def __init__(self, answers: list):
        super().__init__()
        self.answers = answers

    def get_connector_stats(self):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_connector_counters_from_both_roles_are_summed_into_the_stats():
    scheduler = make_scheduler(CountingConnector([{"kv_tier0_hit_blocks": 2}, {}]))
    add(scheduler, "a", PROMPT)
    step(scheduler, kv_connector_stats={"kv_tier0_loaded_blocks": 3})
    step(scheduler, kv_connector_stats={"kv_tier0_loaded_blocks": 1})
    snapshot = scheduler.stats.snapshot()
    assert snapshot["kv_tier0_hit_blocks"] == 2 and snapshot["kv_tier0_loaded_blocks"] == 4
    assert snapshot["kv_connector_errors"] == 0


@pytest.mark.parametrize("answer", [["not", "a", "dict"], {"x": "many"}, {3: 1}, {"x": True}])
def test_garbled_connector_counters_are_a_contained_connector_error(answer):
    scheduler = make_scheduler(CountingConnector([answer]))
    a = add(scheduler, "a", PROMPT)
    run_to_completion(scheduler)
    assert a.output_token_ids == [TOKEN] * 3
    snapshot = scheduler.stats.snapshot()
    assert snapshot["kv_connector_errors"] >= 1 and "x" not in snapshot


def test_a_connector_counter_never_hides_an_engine_counter():
    scheduler = make_scheduler(CountingConnector([{"prompt_tokens_computed": 10**6}, {}]))
    add(scheduler, "a", PROMPT)
    run_to_completion(scheduler)
    assert scheduler.stats.snapshot()["prompt_tokens_computed"] == len(PROMPT)


# ----- issue 20 item 3: connectors see a read-only view, not the engine's Request -------------
class ViewRecordingConnector(FakeConnector):
    """Keeps every request object the scheduler hands it, and tries to change each."""

    def __init__(self, claims):
        super().__init__(claims)
        self.seen: list = []

    def _record(self, request):
        self.seen.append(request)
        with pytest.raises(dataclasses.FrozenInstanceError):
            request.num_computed_tokens = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._record(request)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self._record(request)
        super().update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(self, request, block_ids):
        self._record(request)
        return super().request_finished(request, block_ids)


def test_connector_sees_a_read_only_request_view():
    connector = ViewRecordingConnector({"a": [(8, False)]})
    scheduler = make_scheduler(connector)
    a = add(scheduler, "a", PROMPT, max_tokens=2)
    update_block_hashes(a.block_hashes, a.prompt_token_ids, BLOCK)  # the engine's job
    run_to_completion(scheduler)
    assert len(connector.seen) == 3  # lookup, allocation, end
    assert all(type(view) is KVRequestView for view in connector.seen)
    lookup, alloc, finished = connector.seen
    assert lookup.request_id == "a" and lookup.prompt_token_ids == tuple(PROMPT)
    assert lookup.num_prompt_tokens == len(PROMPT)
    assert lookup.block_hashes == tuple(a.block_hashes[: len(PROMPT) // BLOCK])
    assert lookup.sampling_params is a.sampling_params
    assert (lookup.num_computed_tokens, alloc.num_computed_tokens) == (0, 0)
    assert a.output_token_ids == [TOKEN, TOKEN]  # the view's failed write changed nothing
    assert finished.request_id == "a"
