"""The public API: LLM.generate, the step-level LLM.engine, outputs, and bad inputs."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import hf_greedy, random_prompts

from kvrecover import LLM, CompletionOutput, RequestOutput, SamplingParams

VOCAB = 384
PROMPTS = random_prompts(4, [9, 40, 3, 75], VOCAB, seed=21)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", block_size=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """Each prompt generated alone: what any batch composition must reproduce."""
    return [
        llm.generate([{"prompt_token_ids": p}], greedy(10))[0].outputs[0].token_ids
        for p in PROMPTS
    ]


def run_to_completion(engine, max_steps: int = 500) -> dict[str, RequestOutput]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finished
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finished
                finished[output.request_id] = output
    raise AssertionError("the engine did not finish")


def free_blocks(llm: LLM) -> int:
    return llm.engine.scheduler.kv_manager.pool.num_free_blocks


# ----- LLM.generate -------------------------------------------------------------------


def test_generate_returns_outputs_in_input_order(llm, reference):
    # Different lengths and budgets make the requests finish in another order.
    params = [greedy(10), greedy(2), greedy(7), greedy(1)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert [o.outputs[0].token_ids for o in outputs] == [
        ref[: p.max_tokens] for ref, p in zip(reference, params)
    ]
    assert len({o.request_id for o in outputs}) == 4


def test_request_output_fields(llm, reference):
    tokenizer = llm.get_tokenizer()
    (output,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(10))
    assert isinstance(output, RequestOutput)
    assert output.finished is True
    assert output.prompt is None
    assert output.prompt_token_ids == PROMPTS[0]
    assert output.error is None
    assert len(output.outputs) == 1
    completion = output.outputs[0]
    assert isinstance(completion, CompletionOutput)
    assert completion.index == 0
    assert completion.token_ids == reference[0]
    assert completion.text == tokenizer.decode(reference[0])
    assert completion.finish_reason == "length"


def test_string_and_token_id_prompts_agree(llm, tiny_llama):
    text = "the capital of france is"
    ids = llm.get_tokenizer().encode(text)
    outputs = llm.generate(
        [text, {"prompt_token_ids": ids}, {"prompt": text, "prompt_token_ids": ids}], greedy(6)
    )
    assert [o.prompt for o in outputs] == [text, None, text]
    assert all(o.prompt_token_ids == ids for o in outputs)
    expected = hf_greedy(tiny_llama, [ids], max_new_tokens=6)[0]  # an independent reference
    assert [o.outputs[0].token_ids for o in outputs] == [expected] * 3
    assert all(o.outputs[0].text == llm.get_tokenizer().decode(expected) for o in outputs)


def test_a_single_prompt_and_default_params(tiny_llama):
    """Default SamplingParams sample randomly, seeded from the engine seed and the
    request's arrival order: two fresh engines give the same tokens, another seed others."""

    def first_request_tokens(seed: int) -> list[int]:
        with LLM(str(tiny_llama), device="cpu", block_size=8, seed=seed) as fresh:
            (output,) = fresh.generate({"prompt_token_ids": PROMPTS[1]})
        completion = output.outputs[0]
        assert completion.finish_reason in ("stop", "length")
        assert 1 <= len(completion.token_ids) <= SamplingParams().max_tokens
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == SamplingParams().max_tokens
        else:
            assert completion.token_ids[-1] == 1  # the tiny model's EOS
        return completion.token_ids

    tokens = first_request_tokens(seed=0)
    assert first_request_tokens(seed=0) == tokens
    assert first_request_tokens(seed=1) != tokens


# ----- LLM.engine -----------------------------------------------------------------------


def test_step_reports_progress_then_the_finished_output(llm, reference):
    engine = llm.engine
    engine.add_request("progress", {"prompt_token_ids": PROMPTS[1]}, greedy(5))
    assert engine.has_unfinished()
    seen: list[RequestOutput] = []
    while engine.has_unfinished():
        seen.extend(engine.step())
    # 40 prompt tokens in chunks of 32: the first step computes but does not sample.
    assert [o.request_id for o in seen] == ["progress"] * 5
    assert [o.outputs[0].token_ids for o in seen] == [reference[1][:n] for n in range(1, 6)]
    assert [o.finished for o in seen] == [False] * 4 + [True]
    assert [o.outputs[0].finish_reason for o in seen] == [None] * 4 + ["length"]
    assert all(o.outputs[0].text == "" for o in seen[:4])
    assert seen[-1].outputs[0].text == llm.get_tokenizer().decode(reference[1][:5])
    assert engine.step() == []


def test_requests_added_between_steps(llm, reference):
    engine = llm.engine
    engine.add_request("early", PROMPTS[0], greedy(10))  # a plain token-id list works too
    for _ in range(3):
        engine.step()
    engine.add_request("late", {"prompt_token_ids": PROMPTS[3]}, greedy(10))
    engine.step()
    engine.add_request("later", {"prompt_token_ids": PROMPTS[2]}, greedy(10))
    finished = run_to_completion(engine)
    assert sorted(finished) == ["early", "late", "later"]
    assert finished["early"].outputs[0].token_ids == reference[0]
    assert finished["late"].outputs[0].token_ids == reference[3]
    assert finished["later"].outputs[0].token_ids == reference[2]
    assert not engine.has_unfinished()


def test_abort_request(llm, reference):
    engine = llm.engine
    blocks_before = free_blocks(llm)
    engine.add_request("keep", {"prompt_token_ids": PROMPTS[1]}, greedy(10))
    engine.add_request("drop", {"prompt_token_ids": PROMPTS[3]}, greedy(10))
    engine.add_request("drop-waiting", {"prompt_token_ids": PROMPTS[2]}, greedy(10))
    engine.step()
    engine.step()
    engine.abort_request("drop")
    engine.abort_request("drop-waiting")
    engine.abort_request("no-such-request")  # unknown ids are ignored
    reported = []
    while engine.has_unfinished():
        reported.extend(o.request_id for o in engine.step())
    assert set(reported) == {"keep"}
    # The kept request is unaffected; every block is back in the pool.
    assert free_blocks(llm) == blocks_before
    engine.add_request("drop", {"prompt_token_ids": PROMPTS[3]}, greedy(10))  # id reusable
    assert run_to_completion(engine)["drop"].outputs[0].token_ids == reference[3]


def test_abort_before_the_first_step(llm):
    engine = llm.engine
    engine.add_request("never-run", {"prompt_token_ids": PROMPTS[0]}, greedy(4))
    engine.abort_request("never-run")
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_snapshot_reports_queues_kv_use_and_counters(llm):
    """`LLM.snapshot()` (what `/metrics` shows): the queues, the fraction of usable KV
    blocks in use, and the counters, as the scheduler and the block pool see them."""
    pool = llm.engine.scheduler.kv_manager.pool
    idle = llm.snapshot()
    assert (idle.num_running, idle.num_waiting, idle.kv_cache_usage) == (0, 0, 0.0)
    assert idle.stats == llm.stats
    llm.engine.add_request("snap-a", {"prompt_token_ids": PROMPTS[0]}, greedy(5))
    llm.engine.add_request("snap-b", {"prompt_token_ids": PROMPTS[1]}, greedy(5))
    waiting = llm.snapshot()
    assert (waiting.num_running, waiting.num_waiting, waiting.kv_cache_usage) == (0, 2, 0.0)
    llm.engine.step()
    running = llm.snapshot()
    in_use = pool.num_usable_blocks - pool.num_free_blocks
    assert in_use > 0
    assert (running.num_running, running.num_waiting) == (2, 0)
    assert running.kv_cache_usage == in_use / pool.num_usable_blocks
    assert running.stats == llm.stats
    assert running.stats["prompt_tokens_computed"] > idle.stats["prompt_tokens_computed"]
    llm.engine.abort_request("snap-a")
    llm.engine.abort_request("snap-b")
    done = llm.snapshot()
    assert (done.num_running, done.num_waiting, done.kv_cache_usage) == (0, 0, 0.0)


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.engine
    engine.add_request("dup", {"prompt_token_ids": PROMPTS[0]}, greedy(2))
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request("dup", {"prompt_token_ids": PROMPTS[1]}, greedy(2))
    assert list(run_to_completion(engine)) == ["dup"]


# ----- bad inputs -------------------------------------------------------------------


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="neither a local checkpoint folder"):
        LLM(str(tmp_path / "no-such-model"), device="cpu")
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture(tiny_llama, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        LLM(str(folder), device="cpu")


def test_prompt_longer_than_max_model_len(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", max_model_len=64)
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": list(range(2, 66))}]
    with pytest.raises(ValueError, match="prompt of 64 tokens does not fit max_model_len=64"):
        llm.generate(prompts, greedy(4))
    # The valid prompt queued before the bad one was withdrawn; the engine still works.
    assert not llm.engine.has_unfinished()
    (output,) = llm.generate(prompts[:1], greedy(4))
    assert len(output.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0 .0 is only for scoring a prompt"),
        ({"max_tokens": -3}, "max_tokens must be an integer >= 0"),
        ({"temperature": -0.1}, r"temperature must be 0 \(greedy\) or a finite number >= 1e-05"),
        ({"temperature": float("nan")}, r"temperature must be 0 \(greedy\) or a finite number >= 1e-05"),
        ({"top_p": 0.0}, r"top_p must be a finite number >= 1e-06 and <= 1"),
        ({"top_p": 1.5}, r"top_p must be a finite number >= 1e-06 and <= 1"),
        ({"top_k": 0}, "top_k must be -1"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="non-empty list"):
        llm.generate([], greedy(2))
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        llm.generate([{"prompt_token_ids": []}], greedy(2))
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {VOCAB}\)"):
        llm.generate([{"prompt_token_ids": [5, VOCAB]}], greedy(2))
    with pytest.raises(ValueError, match="a prompt must be a string"):
        llm.generate([3.5], greedy(2))
    with pytest.raises(ValueError, match="got 2 sampling params for 1 prompts"):
        llm.generate(["hello"], [greedy(2), greedy(2)])
    with pytest.raises(ValueError, match="sampling_params must be a kvrecover.SamplingParams"):
        llm.generate(["hello"], [{"max_tokens": 2}])
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"dtype": "fp32"}, "dtype must be one of"),
        ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda"),
        ({"device": "meta"}, "device must be 'auto', 'cpu' or 'cuda"),
        ({"device": "cuda:x"}, "device must be 'auto', 'cpu' or 'cuda"),
        ({"block_size": 0}, "block_size must be an integer >= 1"),
        ({"num_kv_blocks": 1}, "num_kv_blocks must be an integer >= 2"),
    ],
)
def test_bad_engine_args(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), **kwargs)


def test_request_larger_than_the_kv_cache(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", block_size=16, num_kv_blocks=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks but the cache has 3"):
        llm.generate([{"prompt_token_ids": list(range(2, 66))}], greedy(4))


def test_truncated_or_mismatched_checkpoint(tiny_llama, tmp_path):
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_llama, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="inconsistent data offsets|truncated"):
        LLM(str(truncated), device="cpu")

    garbage = tmp_path / "garbage"
    shutil.copytree(tiny_llama, garbage)
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a safetensors file"):
        LLM(str(garbage), device="cpu")

    resized = tmp_path / "resized"
    shutil.copytree(tiny_llama, resized)
    config = json.loads((resized / "config.json").read_text())
    config["intermediate_size"] = 96
    (resized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"down_proj.weight.* has shape \(64, 128\), expected \(64, 96\)"):
        LLM(str(resized), device="cpu")

    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    (empty / "tokenizer.json").write_bytes((tiny_llama / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=r"has no \*.safetensors weights"):
        LLM(str(empty), device="cpu")


def test_sliding_window_is_rejected(tiny_llama, tmp_path):
    folder = tmp_path / "windowed"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding-window attention"):
        LLM(str(folder), device="cpu")
