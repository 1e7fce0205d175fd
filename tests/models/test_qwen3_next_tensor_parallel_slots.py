"""A hybrid's recurrent-state slots at tensor_parallel_size 2 (CPU, two processes): each
rank sizes its own pool from its own GPU's free memory, so the engine runs no more
requests at once than the rank with the fewest slots holds. The CPU's pools grow, so a
rank's GPU limit is simulated (`state_slots_rank.py`); outputs stay Hugging Face's."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import hf_greedy, random_prompts
from test_qwen3_next_vs_hf import FAMILIES, build_hybrid

from kvrecover import LLM, SamplingParams
from kvrecover.worker import parallel_runner
from kvrecover.worker.model_runner import ModelRunner

RANK_1_SLOTS = 3
PROMPTS = random_prompts(5, [5, 23, 41, 12, 30], vocab_size=384, seed=1)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory) -> Path:
    return build_hybrid(tmp_path_factory.mktemp("qwen3_5"), **FAMILIES["qwen3_5"])


@pytest.mark.parametrize("rank_0_slots", [8, None])  # a GPU's pool, or one that grows
def test_the_rank_with_the_fewest_state_slots_caps_max_num_seqs(qwen3_5_dir, monkeypatch,
                                                                  rank_0_slots):
    monkeypatch.setattr(ModelRunner, "state_slot_limit", property(lambda runner: rank_0_slots))
    monkeypatch.setattr(parallel_runner, "RANK_MODULE", "state_slots_rank")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    monkeypatch.setenv("KVRECOVER_TEST_RANK_STATE_SLOTS", str(RANK_1_SLOTS))
    with LLM(str(qwen3_5_dir), device="cpu", tensor_parallel_size=2, block_size=4) as llm:
        engine = llm.engine
        assert engine.scheduler_config.max_num_seqs == RANK_1_SLOTS
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, GREEDY)
        outputs, most_running = {}, 0
        for _ in range(200):  # bounded: 5 prompts of 6 tokens, 3 at a time
            if not engine.has_unfinished():
                break
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output.outputs[0].token_ids
            most_running = max(most_running, len(engine.scheduler.running))
    assert most_running == RANK_1_SLOTS
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == hf_greedy(qwen3_5_dir, PROMPTS, 6)
