"""Overlapped decode: the engine launches step N+1 before step N's tokens reach the host.

The real path runs here on the CPU: `ModelRunner.launch_decode` with an eager
forward in place of the CUDA graph (`eager_overlap`), its input tokens gathered
from the previous step's device tensor, plain host buffers and a done-event in
place of pinned memory and CUDA events. On the GPU (tests/ops/test_gpu.py) the same
path replays CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    KV_PROMPTS,
    block_files,
    build_tiny_model,
    copy_store,
    make_kv_llm,
    random_prompt,
    random_prompts,
    storage_transfer,
)

from kvrecover import LLM, SamplingParams
from kvrecover.step_messages import PENDING_TOKEN, ModelRunnerOutput

VOCAB = 384
PROMPTS = random_prompts(6, [9, 40, 3, 75, 17, 1], VOCAB, seed=33)


class LaunchLog:
    """What the overlapped path ran: one entry per `launch_decode`, and the runner
    outputs the scheduler applied for those steps."""

    def __init__(self) -> None:
        self.continued: list[bool] = []  # True: it continued an in-flight step
        self.requests: list[list[str]] = []  # its request ids
        self.sampled: list[bool] = []  # whether it held a randomly sampled request
        self.loads: list[bool] = []  # whether its connector metadata held loads
        self.landed: list[ModelRunnerOutput] = []  # the applied outputs of launched steps
        self.discarded: list[str] = []  # requests whose part of a landed step was void


def enable_overlap(llm: LLM) -> LaunchLog:
    """Turn on the real overlapped path; returns its launch log."""
    runner = llm.engine.model_runner
    scheduler = llm.engine.scheduler
    runner.eager_overlap = True
    launch = runner.launch_decode
    update = scheduler.update_from_output
    log = LaunchLog()
    launched: set[int] = set()

    def logged_launch(scheduler_output, previous=None):
        scheduled = scheduler_output.scheduled
        pending = [s.token_ids == [PENDING_TOKEN] for s in scheduled]
        assert all(pending) == (previous is not None) and (any(pending) == all(pending))
        log.continued.append(previous is not None)
        log.requests.append([s.request_id for s in scheduled])
        log.sampled.append(any(not s.sampling_params.is_greedy for s in scheduled))
        metadata = scheduler_output.kv_connector_metadata
        log.loads.append(metadata is not None and bool(metadata.loads_by_request()))
        launched.add(id(scheduler_output))
        return launch(scheduler_output, previous)

    def logged_update(scheduler_output, output):
        if id(scheduler_output) in launched:
            launched.discard(id(scheduler_output))
            log.landed.append(output)
            for item in scheduler_output.scheduled:
                request = scheduler.requests.get(item.request_id)
                if request is not None and not request.is_finished and (
                    request.num_computed_tokens != item.num_computed_tokens
                ):
                    log.discarded.append(item.request_id)
        return update(scheduler_output, output)

    runner.launch_decode = logged_launch
    scheduler.update_from_output = logged_update
    return log


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
    assert any(launches.continued), "no step continued an in-flight one: the test tests nothing"
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
    assert any(launches.continued)
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
    assert any(launches.continued)


# ----- random sampling on the overlapped path ----------------------------------------------
# Greedy, seeded and unseeded random sampling (an unseeded request's seed comes from the
# engine seed and its arrival number, so both engines must see the same arrivals).
MIXED = [
    {"temperature": 0},
    {"temperature": 0.8, "top_p": 0.9, "seed": 11},
    {"temperature": 1.3, "top_k": 20},
    {"temperature": 0.7, "top_k": 50, "top_p": 0.8, "seed": 5},
    {"temperature": 1.0},
    {"temperature": 0, "top_k": 7},
]


def mixed_params(max_tokens: list[int], stops: list[int] | None = None) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=max_tokens[i], ignore_eos=True, **MIXED[i],
                       stop_token_ids=stops if stops and i % 2 == 0 else None)
        for i in range(len(MIXED))
    ]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_sampled_and_greedy_requests_overlap_with_the_same_tokens(model):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    free = mixed_params([24] * 6)
    plain = make_llm(model)
    free_run = plain.generate(prompts, free)
    params = mixed_params([3, 24, 9, 24, 17, 1], stops=stop_tokens_from(free_run, 3))
    expected = plain.generate(prompts, params)
    overlapped = make_llm(model)
    launches = enable_overlap(overlapped)
    assert token_ids(overlapped.generate(prompts, free)) == token_ids(free_run)
    got = overlapped.generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    assert [o.outputs[0].finish_reason for o in got] == [
        o.outputs[0].finish_reason for o in expected
    ]
    assert {o.outputs[0].finish_reason for o in expected} == {"stop", "length"}
    assert token_ids(free_run)[1] != token_ids(free_run)[0]  # it really sampled
    # Random rows ran on the fast path, continued from pending device tokens.
    assert any(c and s for c, s in zip(launches.continued, launches.sampled))
    assert overlapped.stats["overlapped_steps"] == len(launches.continued) > 20
    assert plain.stats["overlapped_steps"] == 0


@pytest.mark.parametrize("change", [{"temperature": 1e-300}, {"top_k": 2.5}],
                         ids=["invalid-distribution", "sampler-raises"])
def test_a_row_that_cannot_be_sampled_on_the_overlapped_path_fails_alone(model, change):
    """Params changed while the request decodes reach the overlapped sampler: an invalid
    distribution (found on the device) or a raising sampler ends that request with an
    error; the batch around it, launched from its garbage token too, is unaffected."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seed=s)
              for s in range(4)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    expected = token_ids(make_llm(model).generate(prompts, params))
    llm = make_llm(model)
    launches = enable_overlap(llm)
    engine = llm.engine
    bad = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seed=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, bad if i == 1 else params[i])
    finished = {}
    for step in range(100):
        if not engine.has_unfinished():
            break
        if step == 6:
            assert launches.continued and engine.scheduler.requests["1"].output_token_ids
            for name, value in change.items():
                setattr(bad, name, value)
            launched_before = len(launches.continued)
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["0", "1", "2", "3"]
    failed = finished["1"]
    assert failed.outputs[0].finish_reason == "error"
    assert failed.error.startswith("sampling failed: ") and failed.error_type == "internal_error"
    assert [finished[str(i)].outputs[0].token_ids for i in (0, 2, 3)] == [
        expected[i] for i in (0, 2, 3)
    ]
    assert any(launches.continued[launched_before:])
    assert engine.scheduler.kv_manager.pool.num_free_blocks == engine.num_blocks - 1


# ----- with a KV connector -----------------------------------------------------------------
# Block size 16 (conftest's store): a 49-token prefix of a stored prompt loads 3 blocks and
# computes 1 token, a one-token step that the overlapped path runs, sync load included.
def kv_requests():
    """(request id, prompt, params, arrives at step): a new prompt (saved) decodes first;
    stored prompts (loaded) arrive while it decodes."""
    prompts = [random_prompt(40, seed=7), KV_PROMPTS[0], KV_PROMPTS[1][:49], KV_PROMPTS[2],
               KV_PROMPTS[1]]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=m, ignore_eos=True)
              for s, m in ((3, 40), (4, 12))]
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (10, 14, 9)]
    params = [seeded[0], greedy[0], greedy[1], seeded[1], greedy[2]]
    arrivals = [0, 3, 6, 9, 12]
    return [(f"r{i}", {"prompt_token_ids": p}, sp, at)
            for i, (p, sp, at) in enumerate(zip(prompts, params, arrivals))]


def run_arrivals(llm: LLM) -> dict[str, list[int]]:
    engine = llm.engine
    requests = kv_requests()
    finished: dict[str, list[int]] = {}
    for step in range(2000):
        for request_id, prompt, params, at in requests:
            if at == step:
                engine.add_request(request_id, prompt, params)
        if step > max(r[3] for r in requests) and not engine.has_unfinished():
            break
        for output in engine.step():
            if output.finished:
                assert output.outputs[0].finish_reason == "length", output.error
                finished[output.request_id] = output.outputs[0].token_ids
    assert sorted(finished) == [r[0] for r in requests]
    assert engine.scheduler.kv_manager.pool.num_free_blocks == engine.num_blocks - 1
    return finished


@pytest.fixture(scope="module")
def no_connector_tokens(model) -> dict[str, list[int]]:
    """What every run below must produce: the synchronous path, without a connector."""
    return run_arrivals(make_kv_llm(model))


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_steps_with_a_connector_overlap_loads_and_saves(model, pristine_store, tmp_path,
                                                        no_connector_tokens, async_load):
    copy_store(pristine_store, tmp_path / "store")
    stored_before = len(block_files(tmp_path / "store"))
    llm = make_kv_llm(model, storage_transfer(tmp_path / "store", "kv_both",
                                              async_load=async_load, load_timeout_s=20.0))
    launches = enable_overlap(llm)
    assert run_arrivals(llm) == no_connector_tokens
    stats = llm.stats
    assert stats["prompt_tokens_external"] > 0 and stats["kv_load_failed_blocks"] == 0
    assert len(block_files(tmp_path / "store")) > stored_before  # the new prompt was saved
    assert stats["overlapped_steps"] == len(launches.continued)
    assert sum(launches.continued) > 20
    assert any(launches.loads), "no overlapped step carried a load"
    if async_load:  # loads of waiting requests finished while others decoded overlapped
        assert any(output.finished_recving for output in launches.landed)


def fail_void_rows(llm: LLM) -> None:
    """Make every landing step report a failure for each request whose part of it is void
    (rolled back after launch): being void, it must be dropped like the token."""
    runner, scheduler = llm.engine.model_runner, llm.engine.scheduler
    launch = runner.launch_decode

    def launch_failing_void_rows(scheduler_output, previous=None):
        pending = launch(scheduler_output, previous)
        result = pending.result

        def result_with_failures():
            output = result()
            for request_id in scheduler.void_request_ids(scheduler_output):
                output.failed_requests[request_id] = "the void step failed"
            return output

        pending.result = result_with_failures
        return pending

    runner.launch_decode = launch_failing_void_rows


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_load_failures_reported_on_the_overlapped_path_recover_exactly(
        model, pristine_store, tmp_path, no_connector_tokens, async_load):
    """Loads fail mid-run (policy recompute): the failure reports arrive with overlapped
    steps, exactly the affected requests roll back, and a step launched for a request
    before its rollback was known is discarded, never applied."""
    copy_store(pristine_store, tmp_path / "store")
    faults = [{"requests": "all", "blocks": "last", "kind": "missing"}]
    transfer = storage_transfer(tmp_path / "store", "kv_consumer", "FaultInjectionConnector",
                                faults=faults, async_load=async_load, load_timeout_s=20.0)
    llm = make_kv_llm(model, transfer)
    launches = enable_overlap(llm)
    fail_void_rows(llm)
    assert run_arrivals(llm) == no_connector_tokens
    stats = llm.stats
    assert stats["kv_load_failed_blocks"] > 0 and stats["kv_load_recovered_requests"] >= 2
    assert stats["kv_load_failed_requests"] == 0
    assert any(output.invalid_block_ids for output in launches.landed)
    assert sum(launches.continued) > 20
    if not async_load:
        # r2's one-token step loaded (and failed) on the fast path; the step after it was
        # already launched when the rollback landed.
        assert "r2" in launches.discarded
        assert launches.discarded == ["r2"] * len(launches.discarded)


# ----- on a GPU: the same path with CUDA graphs ---------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_overlaps_sampled_requests_and_connector_steps(tmp_path, dtype):
    """CUDA graphs replay the overlapped steps: mixed greedy and random sampling, with a
    connector that saves (first pass) and loads (second pass), give the tokens of the
    synchronous path over the same graphs."""
    gqa = build_tiny_model(tmp_path / "model", num_hidden_layers=2, head_dim=32,
                           num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = mixed_params([3, 24, 9, 24, 17, 1])

    def run(overlap: bool):
        transfer = storage_transfer(tmp_path / f"store-{overlap}", "kv_both")
        llm = LLM(str(gqa), device="cuda:0", dtype=dtype, block_size=16,
                  enable_prefix_caching=False, kv_transfer_config=transfer)
        runner = llm.engine.model_runner
        if not overlap:
            runner.can_overlap = lambda scheduler_output: False
        launches = []
        launch = runner.launch_decode

        def logged_launch(scheduler_output, previous=None):
            scheduled = scheduler_output.scheduled
            launches.append(previous is not None
                            and any(not s.sampling_params.is_greedy for s in scheduled))
            return launch(scheduler_output, previous)

        runner.launch_decode = logged_launch
        saved = token_ids(llm.generate(prompts, params))
        loaded = token_ids(llm.generate(prompts, params))
        assert runner.graphs is not None and runner.graphs.graphs
        return saved, loaded, llm.stats, launches

    saved, loaded, stats, launches = run(overlap=True)
    assert (saved, loaded) == run(overlap=False)[:2]
    assert stats["prompt_tokens_external"] > 0
    assert stats["overlapped_steps"] == len(launches) and sum(launches) > 10
