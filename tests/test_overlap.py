"""Overlapped decode: the engine launches step N+1 before step N's tokens reach the host.

The real path runs here on the CPU: `ModelRunner.launch_decode` with an eager
forward in place of the CUDA graph (`eager_overlap`), its input tokens gathered
from the previous step's device tensor, plain host buffers and a done-event in
place of pinned memory and CUDA events. On the GPU (tests/test_gpu.py) the same
path replays CUDA graphs.
"""

from __future__ import annotations

import pytest
from conftest import random_prompts

from kvrecover import LLM, SamplingParams
from kvrecover.engine.scheduler_output import PENDING_TOKEN

VOCAB = 384
PROMPTS = random_prompts(6, [9, 40, 3, 75, 17, 1], VOCAB, seed=33)


def enable_overlap(llm: LLM) -> list[bool]:
    """Turn on the real overlapped path; returns a launch log (True for a launch that
    continues an in-flight step, whose inputs are still pending on the device)."""
    runner = llm.engine.model_runner
    runner.eager_overlap = True
    launch = runner.launch_decode
    launches: list[bool] = []

    def logged_launch(scheduler_output, previous=None):
        pending = [s.token_ids == [PENDING_TOKEN] for s in scheduler_output.scheduled]
        assert all(pending) == (previous is not None) and (any(pending) == all(pending))
        launches.append(previous is not None)
        return launch(scheduler_output, previous)

    runner.launch_decode = logged_launch
    return launches


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def make_llm(model, **kwargs) -> LLM:
    return LLM(str(model), device="cpu", block_size=8, max_num_batched_tokens=32, **kwargs)


def stop_tokens_from(outputs, step: int) -> list[int]:
    """For every other request, the token it produced at `step`: a stop token that
    ends it early, at a different step for each."""
    return [o.outputs[0].token_ids[step + i % 3] for i, o in enumerate(outputs) if i % 2 == 0]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_overlapped_decode_gives_the_same_outputs(model, prefix_caching):
    plain = make_llm(model, enable_prefix_caching=prefix_caching)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    free_run = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stops = stop_tokens_from(free_run, 3)
    params = [
        SamplingParams(temperature=0, max_tokens=[1, 2, 24, 7, 16, 24][i], ignore_eos=True,
                       stop_token_ids=stops if i % 2 == 0 else None)
        for i in range(len(PROMPTS))
    ]
    expected = plain.generate(prompts, params)
    overlapped = make_llm(model, enable_prefix_caching=prefix_caching)
    launches = enable_overlap(overlapped)
    for _ in range(2):  # the second time, prefix-cache hits (if on) change the schedule
        got = overlapped.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        assert [o.outputs[0].finish_reason for o in got] == [
            o.outputs[0].finish_reason for o in expected
        ]
    assert any(launches), "no step continued an in-flight one: the test tests nothing"
    assert {o.outputs[0].finish_reason for o in expected} == {"stop", "length"}
    engine = overlapped.engine
    assert not engine.has_unfinished()
    assert engine.scheduler.kv_manager.pool.num_free_blocks == engine.num_blocks - 1


def test_requests_added_and_aborted_while_a_step_is_in_flight(model):
    plain = make_llm(model)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [
        plain.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in PROMPTS
    ]
    llm = make_llm(model)
    launches = enable_overlap(llm)
    engine = llm.engine
    for i in (0, 1, 2):
        engine.add_request(str(i), {"prompt_token_ids": PROMPTS[i]}, params)
    finished = {}
    for step in range(200):
        if step == 4:
            engine.add_request("3", {"prompt_token_ids": PROMPTS[3]}, params)
            engine.abort_request("1")
        if step == 9:
            engine.add_request("4", {"prompt_token_ids": PROMPTS[4]}, params)
        if not engine.has_unfinished():
            break
        for output in engine.step():
            assert output.request_id != "1" or step < 4
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert sorted(finished) == ["0", "2", "3", "4"]
    for request_id, tokens in finished.items():
        assert tokens == expected[int(request_id)]
    assert any(launches)
    assert engine.scheduler.kv_manager.pool.num_free_blocks == engine.num_blocks - 1


def test_a_full_cache_ends_overlap_instead_of_preempting(model):
    """The follow-up step never preempts: when blocks run out, the engine lands the
    step and the normal scheduler decides."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    expected = make_llm(model).generate(prompts, params)
    llm = make_llm(model, num_kv_blocks=18)
    launches = enable_overlap(llm)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.stats["num_preemptions"] > 0
    assert any(launches)
