"""A rank that dies or raises in its forward at tensor_parallel_size 2: noticed within a
bounded time, every in-flight request ends with an error naming the rank, the engine
closes, and no rank process is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import random_prompts

from kvrecover import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
DEADLINE_S = 10.0  # from the failure to the engine closed


def start(model_dir) -> LLM:
    return LLM(str(model_dir), device="cpu", block_size=8, num_kv_blocks=64,
               tensor_parallel_size=2)


def add_requests(llm: LLM, count: int = 3) -> list[str]:
    ids = [f"r{i}" for i in range(count)]
    for request_id, prompt in zip(ids, random_prompts(count, [9, 20, 33], 384, seed=7)):
        llm.engine.add_request(request_id, {"prompt_token_ids": prompt}, PARAMS)
    return ids


def step_until_closed(llm: LLM) -> dict:
    """Step until the engine stops; the finished outputs by request id."""
    finished = {}
    started = time.monotonic()
    while llm.engine.has_unfinished():
        for output in llm.engine.step():
            if output.finished:
                finished[output.request_id] = output
        assert time.monotonic() - started < DEADLINE_S
    return finished


def assert_no_rank_left(processes) -> None:
    for process in processes:
        assert process.poll() is not None  # exited and reaped: no orphan
        with pytest.raises(ProcessLookupError):
            os.kill(process.pid, 0)


def assert_failed_cleanly(llm: LLM, finished: dict, ids: list[str], reason: str) -> None:
    assert sorted(finished) == sorted(ids)
    for output in finished.values():
        assert output.outputs[0].finish_reason == "error"
        assert output.error_type == "internal_error"
        assert reason in output.error and "the engine stopped" in output.error
    assert llm.engine.closed and reason in llm.engine.check_health()
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        llm.generate("more", PARAMS)


def test_a_rank_killed_mid_generation_ends_every_request_with_an_error(tiny_llama):
    llm = start(tiny_llama)
    ranks = [rank.process for rank in llm.engine.model_runner.ranks]
    ids = add_requests(llm)
    for _ in range(3):
        llm.engine.step()
    os.kill(ranks[0].pid, signal.SIGKILL)
    started = time.monotonic()
    finished = step_until_closed(llm)
    assert time.monotonic() - started < DEADLINE_S
    assert_failed_cleanly(llm, finished, ids, "rank 1 died (killed by SIGKILL)")
    assert_no_rank_left(ranks)


def test_a_rank_killed_while_idle_is_noticed_between_steps(tiny_llama):
    llm = start(tiny_llama)
    ranks = [rank.process for rank in llm.engine.model_runner.ranks]
    assert llm.engine.check_health() is None
    os.kill(ranks[0].pid, signal.SIGKILL)
    ranks[0].wait(timeout=DEADLINE_S)
    assert "rank 1 died (killed by SIGKILL)" in llm.engine.check_health()
    assert llm.engine.closed
    assert_no_rank_left(ranks)


def test_rank_0_raising_in_its_forward_stops_the_group(tiny_llama, monkeypatch):
    llm = start(tiny_llama)
    ranks = [rank.process for rank in llm.engine.model_runner.ranks]
    mlp = llm.engine.model_runner.runner.model.layers[1].mlp
    ids = add_requests(llm)
    llm.engine.step()

    def broken(x):
        raise RuntimeError("a bad kernel")

    monkeypatch.setattr(mlp, "forward", broken)  # the other rank waits in an all-reduce
    finished = step_until_closed(llm)
    assert_failed_cleanly(llm, finished, ids, "rank 0's forward failed: RuntimeError: a bad kernel")
    assert_no_rank_left(ranks)


CRASHING_CONNECTOR = '''
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector


class RankCrash(BaseException):
    """Not an Exception: no connector guard contains it, so it leaves rank 1's forward."""


class CrashesOnRankOne(SharedStorageConnector):
    steps = 0

    def wait_for_layer_load(self, layer_index):
        if self.layout.tensor_parallel_rank == 1 and layer_index == 1:
            type(self).steps += 1
            if self.steps == 3:
                raise RankCrash("rank 1 lost its device")
        return super().wait_for_layer_load(layer_index)
'''


def test_a_rank_raising_in_its_forward_stops_the_group(tiny_llama, tmp_path):
    from conftest import storage_transfer

    module = tmp_path / "crashing_connector.py"
    module.write_text(CRASHING_CONNECTOR)
    transfer = storage_transfer(tmp_path / "store", "kv_both", connector="CrashesOnRankOne",
                                module_path=str(module))
    llm = LLM(str(tiny_llama), device="cpu", block_size=8, num_kv_blocks=64,
              tensor_parallel_size=2, kv_transfer_config=transfer)
    ranks = [rank.process for rank in llm.engine.model_runner.ranks]
    ids = add_requests(llm)
    finished = step_until_closed(llm)
    assert_failed_cleanly(llm, finished, ids,
                          "rank 1 failed while running a step: RankCrash: rank 1 lost its device")
    assert_no_rank_left(ranks)


ENGINE_SCRIPT = """
import sys
from kvrecover import LLM
llm = LLM(sys.argv[1], device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
print(llm.engine.model_runner.ranks[0].process.pid, flush=True)
sys.stdin.read()  # until killed
"""


def is_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie left for whoever adopted it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def test_a_rank_whose_engine_process_is_killed_exits_too(tiny_llama):
    engine = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(tiny_llama)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        rank_pid = int(engine.stdout.readline())
        assert not is_gone(rank_pid)
        engine.kill()
        engine.wait(timeout=DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while not is_gone(rank_pid):
            assert time.monotonic() < deadline, "the rank outlived its engine: an orphan"
            time.sleep(0.05)
    finally:
        engine.kill()
        engine.wait()
