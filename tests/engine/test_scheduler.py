"""The Scheduler driven directly with fabricated runner outputs: no model, no worker.

Like vLLM's tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py: a
scheduler-role connector that claims what each test says, a step helper that
plays the worker, and exact checks of what the scheduler schedules next
(`scheduler_harness.py`). Covers DESIGN rules 1-7, sync and async loads, both
policies, shared prefix blocks and small caches (issue 15 item 3).
"""

from __future__ import annotations

import random

import pytest
from scheduler_harness import (
    PROMPT,
    TIMEOUT,
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
from kvrecover.step_messages import ModelRunnerOutput


# ----- rule 1: sync loads -------------------------------------------------------------
def test_sync_failure_cuts_back_discards_the_token_and_recomputes_in_place():
    connector = FakeConnector({"a": [(20, False)]})
    scheduler = make_scheduler(connector)
    a = add(scheduler, "a", PROMPT)
    b = add(scheduler, "b", list(range(200, 209)))  # no KV stored: unaffected
    output, progressed = step(scheduler)
    assert slice_of(output, "a").num_computed_tokens == 20  # only the last token computed
    assert connector.allocs[0][2] == 20
    blocks = list(a.block_ids)
    output, progressed = step(scheduler, invalid={blocks[2]})
    # `a`'s second step read invalid KV: its token is discarded, it is cut to block 2.
    assert a.output_token_ids == [TOKEN]  # from step 1, before the failure was known
    assert a.num_computed_tokens == 8 and a.block_ids == blocks
    assert a.status is RequestStatus.RUNNING
    assert b.output_token_ids == [TOKEN, TOKEN] and [r.request_id for r in progressed] == ["b"]
    output, _ = step(scheduler)
    recompute = slice_of(output, "a")
    assert recompute.num_computed_tokens == 8  # nothing valid before the cut is redone
    assert recompute.token_ids == PROMPT[8:] + [TOKEN]
    stats = scheduler.stats
    assert (stats.kv_load_failed_blocks, stats.kv_load_recovered_requests) == (1, 1)
    assert stats.kv_load_recomputed_tokens == 22 - 8
    assert connector.lookups_of("a") == [0]  # a running request never asks again
    run_to_completion(scheduler)
    assert len(a.output_token_ids) == 3 and all_blocks_free(scheduler)


def test_sync_failure_reported_in_the_loading_step():
    scheduler = make_scheduler(FakeConnector({"a": [(20, False)]}))
    a = add(scheduler, "a", PROMPT)
    scheduler_output = scheduler.schedule()
    blocks = list(a.block_ids)
    sampled = {"a": TOKEN}
    scheduler.update_from_output(scheduler_output, ModelRunnerOutput(sampled, {blocks[0]}))
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert scheduler.stats.prompt_tokens_external == 0
    output, _ = step(scheduler)
    assert slice_of(output, "a").num_computed_tokens == 0
    assert slice_of(output, "a").token_ids == PROMPT


# ----- rule 4: policy fail --------------------------------------------------------------
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_policy_fail_ends_only_the_affected_request(async_load):
    connector = FakeConnector({"a": [(20, async_load)]})
    scheduler = make_scheduler(connector, policy="fail")
    a = add(scheduler, "a", PROMPT)
    b = add(scheduler, "b", list(range(200, 209)))
    if async_load:
        step(scheduler)
        report = {"finished_recving": {"a"}}
    else:
        report = {}  # reported in the step that loads
    _, progressed = step(scheduler, invalid=lambda: {a.block_ids[3]}, **report)
    assert a.status is RequestStatus.FINISHED_ERROR
    assert (a.error_type, a.output_token_ids) == ("kv_load_failed", [])
    assert "1 block(s)" in a.error
    assert a in progressed and a.block_ids == []
    assert connector.finished == ["a"]
    assert scheduler.stats.kv_load_failed_requests == 1
    assert scheduler.stats.kv_load_recovered_requests == 0
    run_to_completion(scheduler)
    assert b.status is RequestStatus.FINISHED_LENGTH and b.output_token_ids == [TOKEN] * 3
    assert all_blocks_free(scheduler)


# ----- rule 2: async loads ---------------------------------------------------------------
def test_async_load_waits_until_finished_then_cuts_back_before_running():
    connector = FakeConnector({"a": [(20, True), (0, False)]})
    scheduler = make_scheduler(connector)
    a = add(scheduler, "a", PROMPT)
    for _ in range(3):  # not finished yet: never scheduled
        output, _ = step(scheduler)
        assert slice_of(output, "a") is None
        assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = list(a.block_ids)
    # A failure reported while the load is in flight is remembered, not applied yet.
    step(scheduler, invalid={blocks[3]})
    assert a.num_computed_tokens == 20 and a.block_ids == blocks
    output, _ = step(scheduler, invalid={blocks[1]}, finished_recving={"a"})
    assert a.status is RequestStatus.WAITING and a.num_computed_tokens == 4
    # The next step asks the connector again (retry 1 of 1), which now has nothing.
    output, _ = step(scheduler)
    assert connector.lookups_of("a") == [0, 4]
    assert slice_of(output, "a").num_computed_tokens == 4
    assert slice_of(output, "a").token_ids == PROMPT[4:]
    assert scheduler.stats.kv_load_failed_blocks == 2
    assert scheduler.stats.prompt_tokens_external == 4
    run_to_completion(scheduler)
    assert len(a.output_token_ids) == 3 and all_blocks_free(scheduler)


def test_async_load_that_succeeds_is_counted_and_cached():
    scheduler = make_scheduler(FakeConnector({"a": [(20, True)]}))
    a = add(scheduler, "a", PROMPT)
    step(scheduler)
    output, _ = step(scheduler, finished_recving={"a"})
    assert slice_of(output, "a") is None  # it runs from the next step on
    output, _ = step(scheduler)
    assert slice_of(output, "a").num_computed_tokens == 20
    assert scheduler.stats.prompt_tokens_external == 20
    assert a.num_cached_blocks == 5


def test_two_async_loads_of_one_prefix_fail_independently():
    """Both load the same stored prefix, each into its own blocks (loaded blocks are
    cached only once verified): a failure of one load leaves the other intact."""
    connector = FakeConnector({"a": [(20, True), (0, False)], "b": [(20, True)]})
    scheduler = make_scheduler(connector)
    a = add(scheduler, "a", PROMPT)
    b = add(scheduler, "b", PROMPT + [1, 2, 3])
    step(scheduler)
    assert not set(a.block_ids) & set(b.block_ids)
    step(scheduler, invalid={a.block_ids[2]}, finished_recving={"a", "b"})
    assert (a.num_computed_tokens, b.num_computed_tokens) == (8, 20)
    assert scheduler.stats.kv_load_recovered_requests == 1
    assert scheduler.stats.prompt_tokens_external == 8 + 20
    run_to_completion(scheduler)
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 3
    assert all_blocks_free(scheduler)


# ----- rule 3: shared prefix blocks -------------------------------------------------------
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_shared_block_leaves_the_cache_and_every_holder(policy):
    scheduler = make_scheduler(FakeConnector(), policy=policy)
    owner = add(scheduler, "owner", PROMPT[:13], max_tokens=6)
    step(scheduler)  # owner computed its prompt; 3 full blocks cached
    sharer = add(scheduler, "sharer", PROMPT[:12] + [1, 2, 3, 4, 5], max_tokens=6)
    output, _ = step(scheduler)
    assert slice_of(output, "sharer").num_computed_tokens == 12  # 3 hit blocks
    shared = owner.block_ids[:3]
    assert sharer.block_ids[:3] == shared
    bystander = add(scheduler, "bystander", list(range(300, 310)))
    step(scheduler, invalid={shared[1]})  # e.g. a late integrity check
    if policy == "fail":
        assert owner.status is sharer.status is RequestStatus.FINISHED_ERROR
    else:
        assert owner.num_computed_tokens == sharer.num_computed_tokens == 4
        # Nobody reads a block another request is rewriting.
        assert owner.block_ids[1] != sharer.block_ids[1]
    # A newcomer with the same prefix hits only the valid first block.
    add(scheduler, "newcomer", PROMPT[:13])
    output, _ = step(scheduler)
    assert slice_of(output, "newcomer").num_computed_tokens == 4
    run_to_completion(scheduler)
    assert bystander.output_token_ids == [TOKEN] * 3
    assert all_blocks_free(scheduler)


# ----- rule 5: the engine's own deadline --------------------------------------------------
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("recompute", ["prefix", "blocks"])
def test_a_load_never_reported_finished_expires_and_its_blocks_stay_held(policy, recompute):
    clock = FakeClock()
    connector = FakeConnector({"a": [(16, True)]})
    scheduler = make_scheduler(connector, policy=policy, clock=clock, recompute=recompute)
    a = add(scheduler, "a", PROMPT)
    b = add(scheduler, "b", list(range(200, 209)))
    step(scheduler)
    loading = list(a.block_ids[:4])
    clock.now += TIMEOUT - 0.01
    step(scheduler)
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    clock.now += 0.02
    output, progressed = step(scheduler)
    assert "a" in output.finished_request_ids  # the worker may cancel the load
    assert scheduler.loads.orphans["a"].block_ids[:4] == loading
    assert all(scheduler.kv_manager.block(i).ref_count == 1 for i in loading)
    assert scheduler.stats.kv_load_failed_blocks == 4
    if policy == "fail":
        assert a.status is RequestStatus.FINISHED_ERROR and a in progressed
        assert "deadline" in a.error
    else:
        recompute = slice_of(output, "a")
        assert recompute.num_computed_tokens == 0 and not set(loading) & set(a.block_ids)
        assert connector.lookups_of("a") == [0]  # never asks again for an expired load
    clock.now += TIMEOUT  # the cancel's own deadline passes too
    run_to_completion(scheduler)
    assert b.output_token_ids == [TOKEN] * 3
    assert len(a.output_token_ids) == (0 if policy == "fail" else 3)
    # The engine is done although the worker never confirmed; the blocks stay held...
    assert not scheduler.has_unfinished() and not all_blocks_free(scheduler)
    # ...until it does.
    step(scheduler, finished_recving={"a"})
    assert all_blocks_free(scheduler) and not scheduler.loads.orphans


# ----- rule 6: bounded re-offers ----------------------------------------------------------
@pytest.mark.parametrize("retry_limit", [0, 1, 3])
def test_reoffers_after_total_failures_are_bounded(retry_limit):
    connector = FakeConnector({"a": [(20, True)]})
    scheduler = make_scheduler(connector, retry_limit=retry_limit)
    a = add(scheduler, "a", PROMPT)
    for _ in range(50):
        if not scheduler.has_unfinished():
            break
        in_flight = a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        step(scheduler, invalid=set(a.block_ids) if in_flight else (),
             finished_recving={"a"} if in_flight else ())
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert len(connector.lookups_of("a")) == retry_limit + 1
    assert scheduler.stats.kv_load_recovered_requests == retry_limit + 1
    assert all_blocks_free(scheduler)


# ----- rule 7: nobody's blocks are written by someone else's load -------------------------
def test_abort_keeps_in_flight_blocks_until_the_worker_confirms():
    scheduler = make_scheduler(FakeConnector({"a": [(20, True)]}), num_blocks=9)
    a = add(scheduler, "a", PROMPT)
    step(scheduler)
    held = list(a.block_ids)
    assert scheduler.abort_request("a") is a
    assert scheduler.pop_finished("a") is a
    assert all(scheduler.kv_manager.block(i).ref_count == 1 for i in held)
    with pytest.raises(ValueError, match="'a' is still in use by an async KV load"):
        add(scheduler, "a", PROMPT)
    # A newcomer needing the whole cache waits instead of taking those blocks.
    newcomer = add(scheduler, "new", list(range(300, 329)), max_tokens=2)
    output, _ = step(scheduler)
    assert slice_of(output, "new") is None and scheduler.has_unfinished()
    assert "a" in output.finished_request_ids
    step(scheduler, finished_recving={"a"})
    run_to_completion(scheduler)
    assert newcomer.output_token_ids == [TOKEN] * 2 and all_blocks_free(scheduler)
    add(scheduler, "a", PROMPT)  # confirmed: the id is free again


def test_under_policy_fail_an_in_flight_load_keeps_its_blocks_until_it_ends():
    connector = FakeConnector({"a": [(20, True)]})
    scheduler = make_scheduler(connector, policy="fail")
    a = add(scheduler, "a", PROMPT)
    step(scheduler)
    held = list(a.block_ids)
    _, progressed = step(scheduler, invalid={held[0]})  # the load is still running
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS and a not in progressed
    assert a.block_ids == held
    assert all(scheduler.kv_manager.block(i).ref_count == 1 for i in held)
    _, progressed = step(scheduler, finished_recving={"a"})
    assert a.status is RequestStatus.FINISHED_ERROR and a in progressed
    assert all_blocks_free(scheduler)


# ----- issue 15 item 3: small caches never stall -------------------------------------------
def test_a_chunked_prefill_takes_the_blocks_a_parked_load_holds():
    """`l` finished loading but the budget goes to `h`'s chunks; `h` outgrows the rest of
    the cache. Preempting itself would make no progress (and, before, an empty step)."""
    scheduler = make_scheduler(FakeConnector({"l": [(12, True)]}), num_blocks=9, budget=8)
    parked = add(scheduler, "l", list(range(200, 213)))
    head = add(scheduler, "h", list(range(300, 324)), max_tokens=2)
    for _ in range(40):
        if not scheduler.has_unfinished():
            break
        finished = {"l"} if parked.status is RequestStatus.WAITING_FOR_REMOTE_KVS else set()
        output, progressed = step(scheduler, finished_recving=finished)
        assert output.scheduled or progressed or finished or scheduler.transfers_in_flight()
    assert head.output_token_ids == [TOKEN] * 2 and parked.output_token_ids == [TOKEN] * 3
    assert head.num_preemptions == 0
    assert all_blocks_free(scheduler)


@pytest.mark.parametrize("seed", range(6))
def test_async_loads_on_a_tiny_cache_degrade_to_slower_never_to_an_error(seed):
    """Random prompts, claims and load latencies on a cache that fits one long request:
    heads that find no blocks while finished loads behind them hold some must get them."""
    rng = random.Random(seed)
    claims, latency, requests = {}, {}, []
    connector = FakeConnector(claims)
    scheduler = make_scheduler(connector, num_blocks=11)  # 10 usable blocks
    for index in range(10):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(5, 30))]
        claims[str(index)] = [(len(prompt) - 1, True)]
        latency[str(index)] = rng.randint(0, 4)
        requests.append(add(scheduler, str(index), prompt, max_tokens=rng.randint(1, 10)))
    waited: dict[str, int] = {}
    for _ in range(1000):
        if not scheduler.has_unfinished():
            break
        finished = set()
        for request in requests:
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                waited[request.request_id] = waited.get(request.request_id, 0) + 1
                if waited[request.request_id] > latency[request.request_id]:
                    finished.add(request.request_id)
                    waited[request.request_id] = 0
        output, progressed = step(scheduler, finished_recving=finished)
        # The engine's check: a step that does nothing is fine only while loads are pending.
        assert output.scheduled or progressed or finished or scheduler.transfers_in_flight()
        # Rule 7: blocks an in-flight load writes belong to its request alone.
        for request in requests:
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                loading = set(scheduler.kv_loads.external_block_ids(request))
                assert all(scheduler.kv_manager.block(i).ref_count == 1 for i in loading)
                assert not any(loading & set(other.block_ids)
                               for other in requests if other is not request)
    assert [r.status for r in requests] == [RequestStatus.FINISHED_LENGTH] * 10
    assert [len(r.output_token_ids) for r in requests] == [r.sampling_params.max_tokens
                                                           for r in requests]
    assert scheduler.stats.num_preemptions > 0
    assert all_blocks_free(scheduler)


def test_an_expired_load_whose_own_blocks_it_needs_waits_for_the_cancel_not_an_error():
    """The audit's case: in a small cache the request whose async load expired needs the
    blocks that load still holds. The cancel goes to the worker in that very step, so the
    request must wait for its confirmation (within timeout_s) and recompute, not end with
    "never confirmed" the step its load expired."""
    clock = FakeClock()
    scheduler = make_scheduler(FakeConnector({"a": [(16, True)]}), num_blocks=9, clock=clock)
    a = add(scheduler, "a", PROMPT)  # 21 tokens + 3 out: 6 blocks of 4; the load holds 4
    step(scheduler)
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    clock.now += TIMEOUT + 0.01
    output, _ = step(scheduler)  # expired: 4 blocks orphaned, 4 free, `a` needs 6
    assert "a" in output.finished_request_ids and not a.is_finished
    assert scheduler.transfers_in_flight() and scheduler.has_unfinished()
    step(scheduler, finished_recving={"a"})  # the worker confirms the cancel
    run_to_completion(scheduler)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [TOKEN] * 3
    assert scheduler.stats.kv_load_failed_requests == 0 and all_blocks_free(scheduler)


def test_blocks_leaked_to_an_unconfirmed_load_fail_the_request_instead_of_spinning():
    clock = FakeClock()
    scheduler = make_scheduler(FakeConnector({"a": [(8, True)]}), num_blocks=9, clock=clock)
    a = add(scheduler, "a", PROMPT[:9])
    step(scheduler)
    clock.now += TIMEOUT + 1
    step(scheduler)  # the load expires: the worker is told to cancel it
    clock.now += TIMEOUT + 1  # and never confirms within the cancel's deadline
    run_to_completion(scheduler)  # `a` recomputes in fresh blocks; 2 stay orphaned
    assert len(a.output_token_ids) == 3
    big = add(scheduler, "big", list(range(300, 326)), max_tokens=2)  # needs 7 of 8 blocks
    _, progressed = step(scheduler)
    assert big.status is RequestStatus.FINISHED_ERROR and big in progressed
    assert big.error_type == "kv_load_failed" and "never confirmed" in big.error
    assert not scheduler.has_unfinished()


# ----- runner failures: void when the same step's loads failed --------------------------
def test_a_runner_failure_in_a_step_whose_own_load_failed_is_void():
    """The loading step read invalid KV (NaN from a failed load), so its sampler failed
    too: recovery rolls the request back and the failure is dropped with the token."""
    scheduler = make_scheduler(FakeConnector({"a": [(20, False)]}))
    a = add(scheduler, "a", PROMPT)
    b = add(scheduler, "b", list(range(200, 209)))
    scheduler_output = scheduler.schedule()
    blocks = list(a.block_ids)
    runner_output = ModelRunnerOutput(
        {"b": TOKEN}, {blocks[0]},
        failed_requests={"a": "sampling failed: the distribution holds inf or nan"})
    progressed = scheduler.update_from_output(scheduler_output, runner_output)
    assert [r.request_id for r in progressed] == ["b"]
    assert not a.is_finished and a.error is None and a.num_computed_tokens == 0
    assert a.pending_external is None
    output, _ = step(scheduler)
    assert slice_of(output, "a").token_ids == PROMPT
    run_to_completion(scheduler)
    assert a.output_token_ids == [TOKEN] * 3 and b.output_token_ids == [TOKEN] * 3
    stats = scheduler.stats
    assert (stats.kv_load_recovered_requests, stats.kv_load_failed_requests) == (1, 0)
    assert stats.prompt_tokens_external == 0 and all_blocks_free(scheduler)


def test_a_runner_failure_without_failed_loads_ends_only_that_request():
    scheduler = make_scheduler()
    a = add(scheduler, "a", list(range(100, 109)))
    b = add(scheduler, "b", list(range(200, 209)))
    scheduler_output = scheduler.schedule()
    runner_output = ModelRunnerOutput({"b": TOKEN}, failed_requests={"a": "the step failed"})
    progressed = scheduler.update_from_output(scheduler_output, runner_output)
    assert {r.request_id for r in progressed} == {"a", "b"}
    assert a.status is RequestStatus.FINISHED_ERROR
    assert (a.error, a.error_type) == ("the step failed", "internal_error")
    assert a.output_token_ids == [] and a.num_computed_tokens == 0  # its part never applied
    run_to_completion(scheduler)
    assert b.output_token_ids == [TOKEN] * 3 and all_blocks_free(scheduler)


# ----- issue 23: the worker frees what it holds for a preempted request ------------------
def test_preempted_requests_are_named_in_the_next_schedule_once():
    """A hybrid model's recurrent-state slots are freed by these ids (the request restarts
    from 0); each preemption is named once, in the schedule that made it."""
    scheduler = make_scheduler(num_blocks=7, budget=64)
    requests = [add(scheduler, name, list(range(10 * i, 10 * i + 9)), max_tokens=8)
                for i, name in enumerate("abc")]
    named: list[str] = []
    for _ in range(60):
        if not scheduler.has_unfinished():
            break
        output, _ = step(scheduler)
        named += sorted(output.preempted_request_ids)
        assert not output.preempted_request_ids & {s.request_id for s in output.scheduled
                                                    if s.num_computed_tokens > 0}
    assert sum(r.num_preemptions for r in requests) == len(named) > 0
    assert all_blocks_free(scheduler)
