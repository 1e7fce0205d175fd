"""A tensor-parallel rank that stops (SIGSTOP) or hangs (issue 41 item 7): the engine
option `rank_timeout_s` bounds how long rank 0 waits for it, and the error names the rank."""

from __future__ import annotations

import argparse
import math
import os
import signal
import time

import pytest
from conftest import random_prompts

from kvrecover import LLM, SamplingParams
from kvrecover.config import RANK_TIMEOUT_S, EngineArgs, add_engine_flags
from kvrecover.worker.parallel_runner import RankSpec

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
RANK_TIMEOUT = 3.0
BOUND_S = 20.0  # from the stop to every request ended with the error


def test_the_default_leaves_no_request_waiting_minutes():
    assert EngineArgs().rank_timeout_s == RANK_TIMEOUT_S <= 30.0
    assert RankSpec.__dataclass_fields__["rank_timeout_s"].default == RANK_TIMEOUT_S


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "x", True])
def test_a_bad_rank_timeout_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="rank_timeout_s must be"):
        EngineArgs(rank_timeout_s=value)


def test_rank_timeout_is_a_flag():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    namespace = parser.parse_args(["--rank-timeout-s", "4.5"])
    assert namespace.rank_timeout_s == 4.5


def test_a_stopped_rank_fails_every_request_within_the_deadline_naming_it(tiny_llama,
                                                                          monkeypatch):
    llm = LLM(str(tiny_llama), device="cpu", block_size=8, num_kv_blocks=64,
              tensor_parallel_size=2, rank_timeout_s=RANK_TIMEOUT)
    assert llm.engine.model_runner.rank_timeout_s == RANK_TIMEOUT
    rank = llm.engine.model_runner.ranks[0].process
    try:
        ids = [f"r{i}" for i in range(3)]
        for request_id, prompt in zip(ids, random_prompts(3, [9, 20, 33], 384, seed=7)):
            llm.engine.add_request(request_id, {"prompt_token_ids": prompt}, PARAMS)
        for _ in range(2):
            llm.engine.step()
        os.kill(rank.pid, signal.SIGSTOP)
        started, finished = time.monotonic(), {}
        while llm.engine.has_unfinished():
            for output in llm.engine.step():
                if output.finished:
                    finished[output.request_id] = output
            assert time.monotonic() - started < BOUND_S
        waited = time.monotonic() - started
        assert RANK_TIMEOUT * 0.9 <= waited < BOUND_S
        assert sorted(finished) == ids
        reason = "rank 1 missed its 3 s deadline (stopped or hung?) while running a step"
        for output in finished.values():
            assert output.outputs[0].finish_reason == "error"
            assert output.error_type == "internal_error" and reason in output.error
        assert llm.engine.closed and reason in llm.engine.check_health()
    finally:
        try:
            os.kill(rank.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        llm.close()
    rank.wait(timeout=10)  # stopped and reaped: no orphan
    with pytest.raises(ProcessLookupError):
        os.kill(rank.pid, 0)
