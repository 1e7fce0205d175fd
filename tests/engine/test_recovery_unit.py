"""KVLoadRecovery on its own: the decisions of DESIGN rules 1-7, no scheduler, no model."""

from __future__ import annotations

import pytest

from kvrecover.engine.recovery import KVLoadRecovery
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.sampling import SamplingParams

BLOCK = 4


def make_request(request_id: str, num_tokens: int, block_ids: list[int], num_computed: int,
                 status: RequestStatus = RequestStatus.RUNNING) -> Request:
    request = Request(request_id, None, list(range(num_tokens)), SamplingParams(max_tokens=4),
                      frozenset(), 0, 1024)
    request.block_ids = list(block_ids)
    request.num_computed_tokens = num_computed
    request.status = status
    return request


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_cut_back_to_the_first_invalid_computed_block(policy):
    recovery = KVLoadRecovery(BLOCK, policy, retry_limit=1)
    hit = make_request("hit", 20, [5, 6, 7, 8, 9], 20)
    untouched = make_request("untouched", 20, [10, 11, 12, 13, 14], 20)
    plan = recovery.plan({7, 9, 12345}, [hit, untouched])
    assert [v.request_id for v in plan.requests] == ["hit"]
    verdict = plan.requests[0]
    assert (verdict.first_invalid_block, verdict.rollback_to) == (2, 8)
    assert (verdict.num_invalid_blocks, verdict.num_tokens_lost) == (2, 12)
    assert verdict.fail is (policy == "fail")
    assert "2 block(s)" in verdict.error
    # Every reported id leaves the prefix cache, held or not.
    assert plan.uncache_block_ids == {7, 9, 12345}
    assert plan.num_failed_blocks == 3
    # Recovery only decides: the requests themselves are unchanged.
    assert hit.num_computed_tokens == 20 and hit.block_ids == [5, 6, 7, 8, 9]


def test_blocks_past_the_computed_tokens_are_not_a_failure_of_the_request():
    recovery = KVLoadRecovery(BLOCK)
    # 9 tokens computed: blocks 0-2 hold them, block 3 is allocated but not computed.
    request = make_request("a", 16, [1, 2, 3, 4], 9)
    assert recovery.plan({4}, [request]).requests == []
    verdict = recovery.plan({3}, [request]).requests[0]
    assert (verdict.rollback_to, verdict.num_tokens_lost) == (8, 1)


def test_a_shared_block_fails_every_request_that_counts_it_computed():
    recovery = KVLoadRecovery(BLOCK)
    owner = make_request("owner", 12, [1, 2, 3], 12)
    sharer = make_request("sharer", 16, [1, 2, 3, 4], 16)
    other = make_request("other", 8, [1, 9], 8)  # shares only the valid first block
    plan = recovery.plan({2}, [owner, sharer, other])
    assert {v.request_id: v.rollback_to for v in plan.requests} == {"owner": 4, "sharer": 4}
    assert plan.uncache_block_ids == {2}


def test_an_in_flight_load_is_judged_once_it_ends():
    recovery = KVLoadRecovery(BLOCK)
    loading = make_request("a", 20, [1, 2, 3, 4, 5], 16, RequestStatus.WAITING_FOR_REMOTE_KVS)
    plan = recovery.plan({3}, [loading])
    assert plan.requests == [] and plan.uncache_block_ids == {3}
    assert recovery.has_deferred
    # Still in flight on the next report: still not judged, the new block remembered too.
    assert recovery.plan({2}, [loading]).requests == []
    loading.status = RequestStatus.WAITING  # the worker reported the load finished
    plan = recovery.plan(set(), [loading])
    assert [(v.request_id, v.rollback_to) for v in plan.requests] == [("a", 4)]
    assert plan.num_failed_blocks == 0  # counted when they were reported
    assert not recovery.has_deferred


def test_forget_drops_what_was_remembered_for_an_ended_request():
    recovery = KVLoadRecovery(BLOCK)
    loading = make_request("a", 20, [1, 2, 3, 4, 5], 16, RequestStatus.WAITING_FOR_REMOTE_KVS)
    recovery.plan({3}, [loading])
    recovery.forget("a")
    loading.status = RequestStatus.WAITING
    assert recovery.plan(set(), [loading]).requests == []


@pytest.mark.parametrize("retry_limit", [0, 1, 2])
def test_reconsulting_the_connector_is_bounded(retry_limit):
    recovery = KVLoadRecovery(BLOCK, "recompute", retry_limit)
    waiting = make_request("a", 20, [1, 2, 3, 4, 5], 16, RequestStatus.WAITING)
    reconsults = 0
    for _ in range(5):
        verdict = recovery.plan({1}, [waiting]).requests[0]
        reconsults += verdict.may_reconsult
        waiting.num_kv_load_failures += 1  # what the scheduler does with each verdict
    assert reconsults == retry_limit
    assert not recovery.may_consult_connector(waiting)
    # A running request (sync load) recomputes at once, never asks again.
    running = make_request("b", 20, [1, 2, 3, 4, 5], 20)
    assert not KVLoadRecovery(BLOCK, "recompute", 5).plan({1}, [running]).requests[0].may_reconsult
    # Under policy fail nothing is retried.
    fresh = make_request("c", 20, [1, 2, 3, 4, 5], 16, RequestStatus.WAITING)
    assert not KVLoadRecovery(BLOCK, "fail", 5).plan({1}, [fresh]).requests[0].may_reconsult


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_an_expired_load_failed_all_its_blocks_and_orphans_them(policy):
    recovery = KVLoadRecovery(BLOCK, policy)
    # 2 local hit blocks, then 3 external blocks being loaded (tokens 8..20).
    loading = make_request("a", 21, [1, 2, 3, 4, 5, 6], 20, RequestStatus.WAITING_FOR_REMOTE_KVS)
    loading.pending_external = (8, 20)
    recovery.plan({4}, [loading])  # deferred: superseded by the expiry
    plan = recovery.plan_expired_loads([loading])
    verdict = plan.requests[0]
    assert verdict.orphan_blocks and not verdict.may_reconsult
    assert (verdict.first_invalid_block, verdict.rollback_to) == (2, 8)
    assert (verdict.num_invalid_blocks, verdict.num_tokens_lost) == (3, 12)
    assert verdict.fail is (policy == "fail")
    assert plan.uncache_block_ids == {3, 4, 5} and plan.num_failed_blocks == 3
    assert not recovery.has_deferred


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_connector_error_fails_or_recomputes_per_policy(policy):
    recovery = KVLoadRecovery(BLOCK, policy)
    request = make_request("a", 20, [], 0, RequestStatus.WAITING)
    verdict = recovery.plan_connector_error(request, "lookup: RuntimeError('boom')")
    assert verdict.fail is (policy == "fail")
    assert (verdict.rollback_to, verdict.num_tokens_lost, verdict.may_reconsult) == (0, 0, False)
    assert "boom" in verdict.error
