"""The server's engine thread, in process: continuous batching across callers,
abort, rejection, and a failing step that stops the loop and fails open requests."""

from __future__ import annotations

import asyncio

import pytest
from conftest import build_tiny_model, random_prompts

from kvrecover import LLM, SamplingParams
from kvrecover.entrypoints.server.engine_loop import EngineLoop

WAIT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("loop_model"), seed=5)


@pytest.fixture
def engine_loop(model_dir):
    loop = EngineLoop(lambda: LLM(str(model_dir)))
    loop.start(timeout=WAIT_S)
    yield loop
    loop.stop()


async def collect(stream) -> list:
    outputs = []
    while not outputs or not outputs[-1].finished:
        output = await stream.get(WAIT_S)
        assert output is not None, "no output in time"
        outputs.append(output)
    return outputs


def test_concurrent_requests_match_generate(engine_loop, model_dir):
    prompts = random_prompts(6, [5, 17, 33], 384, seed=2)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    want = [o.outputs[0].token_ids
            for o in LLM(str(model_dir)).generate([{"prompt_token_ids": p} for p in prompts],
                                                  params)]

    async def run():
        streams = [engine_loop.add(f"r{i}", {"prompt_token_ids": p}, params)
                   for i, p in enumerate(prompts)]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(run())
    assert [r[-1].outputs[0].token_ids for r in results] == want
    assert all(len(r) == 9 for r in results)  # one output per token: they streamed


def test_a_burst_of_arrivals_on_an_idle_engine_shares_the_first_step(model_dir, monkeypatch):
    """Clients that arrive together are prefilled together: the idle thread woken by
    the first request waits for the rest of the burst before it steps."""
    import time

    from kvrecover.entrypoints.server import engine_loop as module

    monkeypatch.setattr(module, "BURST_GAP_S", 0.5)  # wide: the test machine is slow
    monkeypatch.setattr(module, "BURST_MAX_S", 2.0)
    batch_sizes: list[int] = []

    def make_llm() -> LLM:
        llm = LLM(str(model_dir))
        step = llm.engine.step

        def counted_step():
            outputs = step()
            batch_sizes.append(len(llm.engine.scheduler.running))
            return outputs
        llm.engine.step = counted_step
        return llm

    loop = EngineLoop(make_llm)
    loop.start(timeout=WAIT_S)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run():
        streams = []
        for i, prompt in enumerate(random_prompts(4, [20], 384, seed=8)):
            streams.append(loop.add(f"b{i}", {"prompt_token_ids": prompt}, params))
            time.sleep(0.01)  # arrivals a little apart, as HTTP requests are
        return await asyncio.gather(*(collect(s) for s in streams))

    try:
        results = asyncio.run(run())
    finally:
        loop.stop()
    assert all(len(r[-1].outputs[0].token_ids) == 3 for r in results)
    assert batch_sizes[0] == 4


def test_abort_frees_the_request(engine_loop):
    async def run():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        stream = engine_loop.add("long", {"prompt_token_ids": [5, 6, 7]}, params)
        first = await stream.get(WAIT_S)
        assert first is not None and not first.finished
        engine_loop.abort("long")
        for _ in range(200):
            snapshot = await engine_loop.snapshot()
            if snapshot.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return snapshot

    snapshot = asyncio.run(run())
    assert (snapshot.num_running, snapshot.num_waiting, snapshot.kv_cache_usage) == (0, 0, 0.0)
    assert snapshot.stats["generation_tokens"] < 500


def test_rejected_request_is_an_invalid_request_error(engine_loop):
    async def run():
        stream = engine_loop.add("bad", {"prompt_token_ids": [1, 10_000]}, SamplingParams())
        return await collect(stream)

    output = asyncio.run(run())[-1]
    assert output.error_type == "invalid_request_error"
    assert "token ids" in output.error
    assert engine_loop.alive


def test_a_bad_string_is_an_invalid_request_error_and_the_loop_goes_on(engine_loop):
    """A lone surrogate made the tokenizer raise TypeError, which killed the loop."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run():
        bad = await collect(engine_loop.add("bad", "abc \ud800 def", params))
        good = await collect(engine_loop.add("good", {"prompt_token_ids": [5, 6]}, params))
        return bad[-1], good[-1]

    bad, good = asyncio.run(run())
    assert bad.error_type == "invalid_request_error" and "lone surrogate" in bad.error
    assert engine_loop.alive
    assert good.error is None and len(good.outputs[0].token_ids) == 3


def test_any_error_adding_one_request_ends_that_request_alone(engine_loop, monkeypatch):
    """Not a ValueError (a bug, not bad input): that request is an internal_error and
    nothing of it stays queued; the loop and the requests around it carry on."""
    engine = engine_loop.llm.engine
    real_add = engine.add_request
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def add_failing_for_one(request_id, prompt, sampling_params):
        real_add(request_id, prompt, sampling_params)
        if request_id == "broken":
            raise TypeError("simulated tokenizer bug")

    monkeypatch.setattr(engine, "add_request", add_failing_for_one)

    async def run():
        streams = [engine_loop.add(rid, {"prompt_token_ids": [5, 6, 7]}, params)
                   for rid in ("before", "broken", "after")]
        results = [(await collect(s))[-1] for s in streams]
        return results, await engine_loop.snapshot()

    (before, broken, after), snapshot = asyncio.run(run())
    assert broken.error_type == "internal_error" and "simulated tokenizer bug" in broken.error
    assert before.outputs[0].token_ids == after.outputs[0].token_ids
    assert len(after.outputs[0].token_ids) == 4 and after.error is None
    assert engine_loop.alive
    assert (snapshot.num_running, snapshot.num_waiting, snapshot.kv_cache_usage) == (0, 0, 0.0)
    assert not engine.scheduler.requests


def test_a_failing_step_stops_the_loop_and_fails_open_requests(engine_loop):
    def broken_step():
        raise RuntimeError("device lost")

    async def run():
        engine_loop.llm.engine.step = broken_step
        stream = engine_loop.add("doomed", {"prompt_token_ids": [5, 6]}, SamplingParams())
        failed = await collect(stream)
        later = await collect(engine_loop.add("after", {"prompt_token_ids": [5]},
                                              SamplingParams()))
        return failed[-1], later[-1]

    failed, later = asyncio.run(run())
    assert failed.error_type == "internal_error" and "device lost" in failed.error
    assert not engine_loop.alive
    assert later.error_type == "internal_error"


def test_stop_closes_the_llm(model_dir):
    loop = EngineLoop(lambda: LLM(str(model_dir)))
    loop.start(timeout=WAIT_S)
    engine = loop.llm.engine
    assert not engine.closed
    loop.stop(timeout=WAIT_S)
    assert engine.closed and not loop.alive
