"""`KVHandoff`'s rules, without processes: what a prefill's answer leaves, which decode
attempt gets the reference, what becomes of a client's `kv_transfer_params`."""

from __future__ import annotations

from kvrecover.entrypoints.proxy.handoff import PREFILL_TRANSFER_PARAMS, KVHandoff
from kvrecover.kv_transfer.p2p.params import RemoteReference

REFERENCE = RemoteReference("engine", "req@1", ((3, 4),), "127.0.0.1", 5600, 1, "fp").as_params()
BODY = {"prompt": "hi", "max_tokens": 4}


def test_the_prefill_request_asks_to_keep_the_prompt_for_a_remote_decode():
    assert PREFILL_TRANSFER_PARAMS["do_remote_decode"] is True
    assert PREFILL_TRANSFER_PARAMS["do_remote_prefill"] is False


def test_a_prefill_answers_reference_goes_to_one_decode_attempt():
    handoff, body = KVHandoff.of(BODY)
    assert body == BODY and not handoff.from_client
    handoff.take_prefill_answer({"choices": [], "kv_transfer_params": REFERENCE})
    assert handoff.for_attempt(body, "prefill") == BODY  # a prefill instance decoding
    assert handoff.for_attempt(body, "decode") == {**BODY, "kv_transfer_params": REFERENCE}
    handoff.attempt_failed("decode", connect_failed=True)  # never arrived: still usable
    assert handoff.for_attempt(body, "decode")["kv_transfer_params"] == REFERENCE
    handoff.attempt_failed("decode", connect_failed=False)  # reached a consumer: spent
    assert handoff.for_attempt(body, "decode") == BODY


def test_an_answer_without_a_usable_reference_leaves_none():
    for answer in ({}, {"kv_transfer_params": None}, [], {"kv_transfer_params": {
            "do_remote_prefill": True}}, {"kv_transfer_params": {**REFERENCE,
                                                                "remote_block_ids": "x"}}):
        handoff, body = KVHandoff.of(BODY)
        handoff.take_prefill_answer(answer)
        assert handoff.for_attempt(body, "decode") == BODY, answer


def test_a_clients_reference_stands_in_for_the_prefill_and_other_params_are_dropped():
    handoff, body = KVHandoff.of({**BODY, "kv_transfer_params": REFERENCE})
    assert handoff.from_client and body == BODY
    assert handoff.for_attempt(body, "decode")["kv_transfer_params"] == REFERENCE
    handoff.drop()
    assert handoff.for_attempt(body, "decode") == BODY
    for other in ({"do_remote_decode": True}, None, "x"):
        handoff, body = KVHandoff.of({**BODY, "kv_transfer_params": other})
        assert not handoff.from_client and body == BODY
        assert handoff.for_attempt(body, "decode") == BODY
