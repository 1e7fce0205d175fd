"""Structured outputs on CUDA (for the GPU run; skipped without CUDA): the torch mask
kernel on the device equals xgrammar's CPU kernel, and grammar steps on the CUDA-graph
engine follow their grammar, do not depend on the batch and leave the other requests
on the overlapped path."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompts
from structured_helpers import PERSON_SCHEMA, schema_errors

from kvrecover import LLM, SamplingParams, StructuredOutputsParams
from kvrecover.structured.bitmask import TokenBitmask
from kvrecover.structured.compiler import GrammarCompiler

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real GPU")]
VOCAB = 384
PROMPTS = random_prompts(3, [9, 30, 17], VOCAB, seed=5)
SPEC = StructuredOutputsParams(json=PERSON_SCHEMA)


def test_the_device_kernel_equals_the_cpu_kernel(tiny_llama):
    compiler = GrammarCompiler(tiny_llama, VOCAB, [1])
    states = [compiler.matcher(SPEC), None, compiler.matcher(StructuredOutputsParams(
        regex="[0-9]{2}"))]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    on_cpu = logits.clone()
    TokenBitmask(torch.device("cpu")).apply(on_cpu, states)
    on_gpu = logits.to("cuda:0")
    TokenBitmask(torch.device("cuda:0")).apply(on_gpu, states)
    assert torch.equal(on_gpu.cpu(), on_cpu)


def test_grammar_steps_replay_graphs_and_keep_the_others_overlapped(tiny_llama):
    llm = LLM(str(tiny_llama), device="cuda:0", attention_backend="triton")
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=SPEC)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params)[0].outputs[0]
    assert schema_errors(json.loads(alone.text), PERSON_SCHEMA) == []
    free = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    before = llm.engine.stats.overlapped_steps
    batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [free, params, free])
    assert batch[1].outputs[0].token_ids == alone.token_ids
    # After the grammar's request ended, the other two decoded on the overlapped path.
    assert llm.engine.stats.overlapped_steps - before >= 200 - len(alone.token_ids) - 10
