"""One bad request never poisons the LLM (issue #15, items 1 and 12).

Parameters that cannot work are a ValueError naming the field, before anything
is queued; whatever still fails inside a step ends that request alone with
finish_reason "error" and error_type "internal_error". After each case the same
LLM must still give the exact expected tokens.
"""

from __future__ import annotations

import pytest
from conftest import random_prompts

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.options import UnknownOptionError

VOCAB = 384
PROMPTS = random_prompts(3, [11, 30, 5], VOCAB, seed=8)
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
# Seeded random sampling: each request's tokens do not depend on its batch.
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5, ignore_eos=True, seed=s)
           for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", block_size=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def expected(llm) -> dict[str, list[list[int]]]:
    """Token ids of every prompt, greedy and sampled, each generated alone."""
    return {
        "greedy": [run(llm, [p], GREEDY)[0] for p in PROMPTS],
        "sampled": [run(llm, [p], params)[0] for p, params in zip(PROMPTS, SAMPLED)],
    }


def run(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def assert_still_healthy(llm: LLM, expected) -> None:
    assert not llm.engine.has_unfinished()
    assert not llm.engine.scheduler.requests
    assert run(llm, PROMPTS, GREEDY) == expected["greedy"]
    assert run(llm, PROMPTS, SAMPLED) == expected["sampled"]
    pool = llm.engine.scheduler.kv_manager.pool
    assert pool.num_free_blocks == llm.engine.num_blocks - 1


# ----- rejected up front ------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": 1e-300}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": 1e-300}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"seed": "abc"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"stop_token_ids": [5.0]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "no"}, "ignore_eos"),
])
def test_sampling_params_that_cannot_work_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [5.7, 6]}, "prompt_token_ids must be a list of integers, got"),
    ({"prompt_token_ids": "123"}, "prompt_token_ids must be a list of integers, got '123'"),
    ({"prompt_token_ids": [True, 5]}, "prompt_token_ids must be a list of integers"),
    ({"prompt_token_ids": [5, None]}, "prompt_token_ids must be a list of integers"),
    ({"prompt_token_ids": [5, VOCAB]}, rf"token ids must be in \[0, {VOCAB}\)"),
    ({"prompt_token_ids": [-1, 5]}, rf"token ids must be in \[0, {VOCAB}\)"),
    ({"prompt_token_ids": [5], "prompt": 7}, "prompt must be a string"),
    ([5.0, 6], "prompt_token_ids must be a list of integers"),
])
def test_bad_prompts_are_rejected_and_nothing_is_queued(llm, expected, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, prompt], GREEDY)
    assert_still_healthy(llm, expected)


@pytest.mark.parametrize("prompt, message", [
    ("abc \ud800 def", "prompt: a lone surrogate .* at character 4"),
    ({"prompt_token_ids": [5], "prompt": "x\udfff"}, "prompt: a lone surrogate"),
    ("a\x00b", "prompt: a NUL character .* at character 1"),
    (b"abc \xff", "a prompt must be a string .* got bytes"),
])
def test_bad_strings_are_a_value_error_naming_the_prompt(llm, expected, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, prompt], GREEDY)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad-string", prompt, GREEDY)
    assert_still_healthy(llm, expected)


def test_stop_token_ids_outside_the_vocabulary_are_rejected(llm, expected):
    params = SamplingParams(temperature=0, stop_token_ids=[3, VOCAB + 1])
    with pytest.raises(ValueError, match=rf"stop_token_ids must be token ids in \[0, {VOCAB}\)"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)
    assert_still_healthy(llm, expected)


# ----- failing inside a step --------------------------------------------------------------
@pytest.mark.parametrize("changes", [
    {"temperature": 1e-300},   # logits / temperature overflow: multinomial meets NaN
    {"top_k": 2.5},            # topk cannot take it
    {"top_p": 0.0},            # every token dropped... but the top one is always kept
], ids=["tiny-temperature", "float-top-k", "zero-top-p"])
def test_a_request_that_fails_in_the_sampler_ends_alone(llm, expected, changes):
    """Params changed after they were validated and queued (the dataclass is mutable)
    reach the sampler: that request fails, the batch around it does not."""
    engine = llm.engine
    bad = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)
    engine.add_request("good-0", {"prompt_token_ids": PROMPTS[0]}, SAMPLED[0])
    engine.add_request("bad", {"prompt_token_ids": PROMPTS[1]}, bad)
    engine.add_request("good-2", {"prompt_token_ids": PROMPTS[2]}, SAMPLED[2])
    for name, value in changes.items():
        setattr(bad, name, value)
    finished = {}
    for _ in range(50):
        if not engine.has_unfinished():
            break
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["bad", "good-0", "good-2"]
    failed = finished["bad"]
    if changes.get("top_p") == 0.0:  # keeping the most likely token makes this one work
        assert failed.outputs[0].finish_reason == "length"
    else:
        assert failed.outputs[0].finish_reason == "error"
        assert failed.error_type == "internal_error"
        assert failed.error.startswith("sampling failed: ")
        assert failed.outputs[0].token_ids == []
    # Batched with the bad one, the others still get exactly their own tokens.
    assert finished["good-0"].outputs[0].token_ids == expected["sampled"][0]
    assert finished["good-2"].outputs[0].token_ids == expected["sampled"][2]
    assert finished["good-0"].error is None and finished["good-2"].error is None
    assert_still_healthy(llm, expected)


def test_params_changed_before_queueing_are_checked_again(llm, expected):
    params = SamplingParams(temperature=0.5)
    params.seed = "abc"
    with pytest.raises(ValueError, match="seed must be an integer"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)
    assert_still_healthy(llm, expected)


def test_a_failing_forward_ends_that_steps_requests_only(llm, expected, monkeypatch):
    """When the whole step fails (not one row), its requests end; later ones run."""
    model = llm.engine.model_runner.model
    real_forward = type(model).forward
    calls = {"n": 0}

    def forward_failing_once(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", forward_failing_once)
    engine = llm.engine
    engine.add_request("first", {"prompt_token_ids": PROMPTS[2]}, GREEDY)
    outputs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason, o.error_type) for o in outputs] == [
        ("first", "error", "internal_error")]
    assert "simulated device fault" in outputs[0].error
    assert calls["n"] == 1
    monkeypatch.undo()
    assert_still_healthy(llm, expected)


# ----- engine options ---------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
    ({"max_num_seqs": True}, "max_num_seqs must be an integer >= 1"),
    ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens must be an integer >= 1"),
    ({"num_kv_blocks": 2.5}, "num_kv_blocks must be an integer >= 2"),
    ({"block_size": True}, "block_size must be an integer >= 1"),
    ({"enforce_eager": 1}, "enforce_eager must be True or False"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"seed": "7"}, "seed must be an integer >= 0"),
    ({"kv_cache_memory_gb": 0}, "kv_cache_memory_gb must be a finite number > 0"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be a finite number > 0"),
    ({"dtype": "float64"}, "dtype must be one of 'auto', 'float32'"),
    ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda"),
    ({"device": 0}, "device must be a string"),
    ({"kv_transfer_config": {"kv_connector": "X"}}, "kv_transfer_config must be a KVTransferConfig"),
    ({"max_model_len": 10**7}, r"max_model_len must be <= 1024 \(the model's max_position_embeddings\)"),
])
def test_bad_engine_options_name_the_field(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), **kwargs)


def test_a_bad_model_value_names_the_field():
    with pytest.raises(ValueError, match="model must be a string"):
        LLM(5)


def test_an_unknown_option_suggests_the_near_miss(tiny_llama):
    with pytest.raises(TypeError, match="unknown LLM option 'max_num_seq'; did you mean "
                                        "'max_num_seqs'"):
        LLM(str(tiny_llama), max_num_seq=4)
    with pytest.raises(UnknownOptionError) as info:
        LLM(str(tiny_llama), no_such_thing=1)
    assert isinstance(info.value, ValueError)
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("make, message", [
    (lambda: KVTransferConfig("SharedStorageConnector", kv_load_retry_limit=True),
     "kv_load_retry_limit must be an integer >= 0"),
    (lambda: KVTransferConfig("SharedStorageConnector", kv_connector_extra_config={1: 2}),
     "kv_connector_extra_config must be a dict with string keys"),
    (lambda: KVTransferConfig("SharedStorageConnector", kv_connector_module_path=""),
     "kv_connector_module_path must be a module name"),
    (lambda: KVTransferConfig.from_json('{"kv_connector": "A", "kv_rol": "kv_both"}'),
     "unknown kv_transfer_config key 'kv_rol'; did you mean 'kv_role'"),
    (lambda: KVTransferConfig.from_json("[1]"), "kv_transfer_config must be a JSON object"),
    (lambda: KVTransferConfig.from_json("{"), "kv_transfer_config is not valid JSON"),
    (lambda: KVTransferConfig.from_json('{"kv_role": "kv_both"}'),
     "kv_transfer_config needs a 'kv_connector'"),
])
def test_bad_kv_transfer_configs_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_kv_transfer_config_round_trips_through_json():
    config = KVTransferConfig("FaultInjectionConnector", "kv_consumer",
                              {"shared_storage_path": "/x", "faults": []}, None, "fail", 3)
    assert KVTransferConfig.from_json(config.to_json()) == config


# ----- connector extra config --------------------------------------------------------------
@pytest.mark.parametrize("connector, extra, message", [
    ("SharedStorageConnector", {"asyn_load": True},
     "unknown kv_connector_extra_config key of SharedStorageConnector 'asyn_load'; "
     "did you mean 'async_load'"),
    ("SharedStorageConnector", {"load_timeout": 3},
     "did you mean 'load_timeout_s'"),
    ("SharedStorageConnector", {"shared_storage_path": 5},
     r"kv_connector_extra_config\['shared_storage_path'\] must be a folder path"),
    ("FaultInjectionConnector", {"fault": []},
     "unknown kv_connector_extra_config key of FaultInjectionConnector 'fault'; "
     "did you mean 'faults'"),
    ("FaultInjectionConnector", {"verify_after_laod": False}, "did you mean 'verify_after_load'"),
    ("FaultInjectionConnector", {"faults": [{"kinds": "missing"}]},
     "unknown fault key 'kinds'; did you mean 'kind'"),
    ("FaultInjectionConnector", {"faults": [{"request": "all"}]},
     "unknown fault key 'request'; did you mean 'requests'"),
    ("FaultInjectionConnector", {"inner_connector": "FaultInjectionConnector"},
     "inner_connector cannot be FaultInjectionConnector itself"),
    ("FaultInjectionConnector", {"inner_connector": "Nope"}, "inner_connector 'Nope'"),
])
def test_connector_config_mistakes_name_the_key(tiny_llama, tmp_path, connector, extra, message):
    extra = {"shared_storage_path": str(tmp_path), **extra}
    transfer = KVTransferConfig(connector, "kv_both", extra)
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), device="cpu", num_kv_blocks=16, kv_transfer_config=transfer)


def test_an_error_escaping_a_step_leaves_no_request_behind(llm, expected, monkeypatch):
    """Whatever escapes `step()` (here: the scheduler) reaches the caller once, and the
    batch's requests are withdrawn, so the next generate starts clean."""
    scheduler = llm.engine.scheduler
    real_schedule = scheduler.schedule
    calls = {"n": 0}

    def schedule_failing_on_the_second_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated scheduler bug")
        return real_schedule()

    monkeypatch.setattr(scheduler, "schedule", schedule_failing_on_the_second_step)
    with pytest.raises(RuntimeError, match="simulated scheduler bug"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    monkeypatch.undo()
    assert_still_healthy(llm, expected)
