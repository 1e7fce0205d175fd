"""`request_finished` returning True keeps a finished request's blocks until the worker
reports the request in `finished_sending` (the connector contract, kv_transfer/base.py;
engine/pending_sends.py). Model-free scheduler tests with fabricated runner outputs,
and one through the engine with a real worker-role connector."""

from __future__ import annotations

import logging

import pytest
from scheduler_harness import (
    PROMPT,
    TIMEOUT,
    FakeClock,
    FakeConnector,
    add,
    all_blocks_free,
    make_scheduler,
    run_to_completion,
    step,
)

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.engine.request import RequestStatus
from kvrecover.kv_transfer.base import KVConnectorBase
from kvrecover.kv_transfer.registry import register_connector


class KeepingConnector(FakeConnector):
    """Scheduler role: keeps the blocks of every finished request (`answer` overrides)."""

    def __init__(self, answer=True, **kwargs):
        super().__init__(**kwargs)
        self.answer = answer
        self.finished_blocks: dict[str, list[int]] = {}

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        self.finished_blocks[request.request_id] = list(block_ids)
        return self.answer


def run_until_finished(scheduler, request, max_steps: int = 50) -> None:
    """Step until `request` ends (the scheduler itself goes on while a send is pending)."""
    for _ in range(max_steps):
        if request.is_finished:
            return
        step(scheduler)
    raise AssertionError(f"request {request.request_id} did not finish within the step bound")


def free_block_ids(scheduler) -> set[int]:
    pool = scheduler.kv_manager.pool
    return {b.block_id for b in pool.blocks if b.ref_count == 0 and b.block_id != 0}


def test_kept_blocks_are_neither_freed_nor_reused_until_reported_sent():
    connector = KeepingConnector()
    scheduler = make_scheduler(connector, num_blocks=16)
    a = add(scheduler, "a", PROMPT, max_tokens=2)
    run_until_finished(scheduler, a)
    assert a.status is RequestStatus.FINISHED_LENGTH
    kept = set(connector.finished_blocks["a"])
    assert len(kept) == 6  # 21 prompt + 1 decoded token in blocks of 4
    assert not all_blocks_free(scheduler)
    assert kept.isdisjoint(free_block_ids(scheduler))
    # Another request runs meanwhile (several steps, with other requests' sends
    # reported): it never gets a kept block, and the kept blocks stay held.
    b = add(scheduler, "b", list(range(300, 330)), max_tokens=3)
    for _ in range(5):
        step(scheduler, finished_sending={"someone-else"})
        assert kept.isdisjoint(b.block_ids)
        assert kept.isdisjoint(free_block_ids(scheduler))
    assert b.is_finished
    step(scheduler, finished_sending={"a"})
    assert kept <= free_block_ids(scheduler)
    assert not all_blocks_free(scheduler)  # b's own blocks wait for b's report
    step(scheduler, finished_sending={"b"})
    assert all_blocks_free(scheduler) and not scheduler.has_unfinished()


def test_a_request_waits_for_blocks_held_by_a_send_then_runs():
    clock = FakeClock()
    connector = KeepingConnector()
    scheduler = make_scheduler(connector, num_blocks=8, clock=clock)  # 7 usable blocks
    run_until_finished(scheduler, add(scheduler, "a", PROMPT, max_tokens=2))  # holds 6 blocks
    b = add(scheduler, "b", list(range(300, 316)), max_tokens=2)  # needs 5 blocks
    for _ in range(3):
        output, _ = step(scheduler)
        assert not output.scheduled and b.status is RequestStatus.WAITING  # not failed
        assert scheduler.transfers_in_flight() and scheduler.has_unfinished()
    step(scheduler, finished_sending={"a"})  # the blocks come back at the end of the step
    run_until_finished(scheduler, b)
    assert b.output_token_ids == [7, 7]
    step(scheduler, finished_sending={"b"})
    assert all_blocks_free(scheduler)


def test_an_unconfirmed_send_holds_its_blocks_past_the_deadline_and_stops_the_stepping(caplog):
    clock = FakeClock()
    connector = KeepingConnector()
    scheduler = make_scheduler(connector, num_blocks=8, clock=clock)
    run_until_finished(scheduler, add(scheduler, "a", PROMPT, max_tokens=2))
    assert scheduler.has_unfinished()  # stepping to collect the report
    clock.now += TIMEOUT + 1
    assert not scheduler.has_unfinished() and not scheduler.transfers_in_flight()
    kept = set(connector.finished_blocks["a"])
    assert kept.isdisjoint(free_block_ids(scheduler))  # still held: the connector may read them
    # A request that cannot fit without them ends with an error instead of waiting forever.
    b = add(scheduler, "b", list(range(300, 316)), max_tokens=2)
    step(scheduler)
    assert b.status is RequestStatus.FINISHED_ERROR and "never confirmed" in b.error
    # A late report still frees them.
    step(scheduler, finished_sending={"a"})
    assert all_blocks_free(scheduler)


def test_an_aborted_request_is_kept_too_and_its_id_waits_for_the_report():
    connector = KeepingConnector()
    scheduler = make_scheduler(connector, num_blocks=16)
    add(scheduler, "a", PROMPT, max_tokens=5)
    step(scheduler)
    assert scheduler.abort_request("a") is not None
    scheduler.pop_finished("a")
    kept = set(connector.finished_blocks["a"])
    assert kept and kept.isdisjoint(free_block_ids(scheduler))
    with pytest.raises(ValueError, match="KV send"):
        add(scheduler, "a", PROMPT)
    step(scheduler, finished_sending={"a"})
    assert all_blocks_free(scheduler)
    add(scheduler, "a", PROMPT)  # the id is free again


@pytest.mark.parametrize("answer", [False, None, "yes", 1])
def test_anything_but_true_frees_the_blocks_at_once(answer, caplog):
    connector = KeepingConnector(answer=answer)
    scheduler = make_scheduler(connector, num_blocks=16)
    add(scheduler, "a", PROMPT, max_tokens=2)
    with caplog.at_level(logging.ERROR, "kvrecover"):
        run_to_completion(scheduler)
    assert all_blocks_free(scheduler) and not scheduler.has_unfinished()
    outside_contract = answer not in (False, None)
    assert ("request_finished" in caplog.text) == outside_contract
    assert scheduler.stats.kv_connector_errors == int(outside_contract)


def test_a_raising_request_finished_frees_the_blocks():
    connector = KeepingConnector(raise_in={"request_finished"})
    scheduler = make_scheduler(connector, num_blocks=16)
    add(scheduler, "a", PROMPT, max_tokens=2)
    run_to_completion(scheduler)
    assert all_blocks_free(scheduler)


# ----- through the engine: the worker role reports the send a few steps later ---------------
class SendingConnector(KVConnectorBase):
    """Both roles. The scheduler role keeps every finished request's blocks; the
    worker role reports each one sent on the third `get_finished` after the engine
    told it the request finished."""

    pending: dict[str, int] = {}  # request id -> get_finished calls left (worker role)
    reported: list[str] = []

    def request_finished(self, request, block_ids):
        return True

    def get_finished(self, finished_req_ids):
        for request_id in finished_req_ids:
            SendingConnector.pending[request_id] = 3
        done = set()
        for request_id in list(SendingConnector.pending):
            SendingConnector.pending[request_id] -= 1
            if SendingConnector.pending[request_id] == 0:
                del SendingConnector.pending[request_id]
                done.add(request_id)
        SendingConnector.reported += sorted(done)
        return done, None


register_connector("SendingConnector", f"{__name__}:SendingConnector")


def test_engine_frees_kept_blocks_once_the_worker_reports_them_sent(tiny_llama):
    SendingConnector.pending.clear()
    SendingConnector.reported.clear()
    llm = LLM(str(tiny_llama), device="cpu", block_size=16, num_kv_blocks=32,
              kv_transfer_config=KVTransferConfig("SendingConnector", "kv_both"))
    engine = llm.engine
    pool = engine.scheduler.kv_manager.pool
    engine.add_request("r", {"prompt_token_ids": list(range(2, 40))},
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    outputs = []
    for _ in range(10):
        outputs = engine.step()
        if outputs and outputs[0].finished:
            break
    assert outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 2
    held = pool.num_usable_blocks - pool.num_free_blocks
    assert held == 3  # 38 prompt + 1 decoded token in blocks of 16
    steps = 0
    while engine.has_unfinished() and steps < 10:
        assert pool.num_free_blocks == pool.num_usable_blocks - held
        engine.step()
        steps += 1
    assert SendingConnector.reported == ["r"] and steps == 3
    assert pool.num_free_blocks == pool.num_usable_blocks
    llm.close()
