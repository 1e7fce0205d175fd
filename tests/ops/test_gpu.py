"""The GPU path: Triton kernels against the torch reference, CUDA graphs, batch
invariance, float32 parity with the CPU path and bf16 parity with Hugging Face.

Marked `gpu` and skipped without CUDA. With `TRITON_INTERPRET=1` the float32
kernel and engine tests also run on the CPU (slowly), through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA, TRITON_TESTS, build_tiny_model, random_prompts
from conftest import TRITON_DEVICE as DEVICE

from kvrecover import LLM, SamplingParams
from kvrecover.step_messages import ScheduledRequest

ENGINE_DEVICE = "cuda:0" if CUDA else "cpu"  # torch 2.11 set_device() rejects a bare "cuda"
pytestmark = TRITON_TESTS
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a real GPU")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_cuda)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _randn(*shape, dtype=torch.float32, generator=None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device=DEVICE, dtype=dtype)


def _make_llm(model_dir, **kwargs) -> LLM:
    """An LLM on the Triton path (on the CPU too, under the interpreter)."""
    return LLM(str(model_dir), device=ENGINE_DEVICE, attention_backend="triton", **kwargs)


# ----- small ops ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_match_reference(dtype):
    from kvrecover.ops.reference.torch_ops import TorchOps
    from kvrecover.ops.triton.fused_ops import TritonOps

    gen = torch.Generator().manual_seed(0)
    x, residual, weight = _randn(37, 320, dtype=dtype, generator=gen), _randn(37, 320, dtype=dtype, generator=gen), _randn(320, dtype=dtype, generator=gen)
    ref_out, ref_res = TorchOps().add_rms_norm(x, residual, weight, 1e-5)
    out, res = TritonOps().add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert torch.equal(res, ref_res)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(
        TritonOps().rms_norm(x, weight, 1e-5), TorchOps().rms_norm(x, weight, 1e-5), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_silu_match_reference(dtype):
    from kvrecover.models.rope import RotaryEmbedding
    from kvrecover.ops.reference.torch_ops import TorchOps
    from kvrecover.ops.triton.fused_ops import TritonOps

    gen = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(32, 512, 500000.0, None).to(DEVICE)
    qkv = _randn(19, (6 + 2 * 2) * 32, dtype=dtype, generator=gen)
    positions = torch.randint(0, 512, (19,), generator=gen).to(DEVICE)
    q, k, _ = qkv.split([6 * 32, 2 * 32, 2 * 32], dim=-1)
    q, k = q.view(19, 6, 32), k.view(19, 2, 32)
    ref_q, ref_k = TorchOps().rotary(rotary, positions, q.clone(), k.clone())
    out_q, out_k = TritonOps().rotary(rotary, positions.to(torch.int32), q, k)
    exact = dtype != torch.float32  # float32 products may fuse into FMAs
    for out, ref in ((out_q, ref_q), (out_k, ref_k)):
        if exact:
            assert torch.equal(out, ref)
        else:
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    gate_up = _randn(23, 2 * 200, dtype=dtype, generator=gen)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(
        TritonOps().silu_mul(gate_up), TorchOps().silu_mul(gate_up), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (12, 4)])
def test_fused_rotary_store_matches_rotary_then_store(dtype, heads, kv_heads):
    """One kernel for rotary + KV store gives the two kernels' bits: query, cache, and
    the unrotated key left alone."""
    from kvrecover.models.rope import RotaryEmbedding
    from kvrecover.ops.triton.attention import store_kv
    from kvrecover.ops.triton.fused_ops import rotary_, rotary_store_

    gen = torch.Generator().manual_seed(2)
    head_dim, tokens, block_size = 64, 21, 16
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None).to(DEVICE)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, generator=gen)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(DEVICE, torch.int32)
    slots = (torch.randperm(5 * block_size, generator=gen)[:tokens] + block_size).to(DEVICE, torch.int32)
    cache = torch.zeros(2, 7, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)

    def views(tensor):
        q, k, v = tensor.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        return (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim),
                v.view(tokens, kv_heads, head_dim))

    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    q, k, v = views(ref_qkv)
    rotary_(rotary, positions, q, k)
    store_kv(k, v, ref_cache, slots)
    fused_qkv = qkv.clone()
    q, k, v = views(fused_qkv)
    rotary_store_(rotary, positions, q, k, v, cache, slots)
    assert torch.equal(cache, ref_cache)
    assert torch.equal(views(fused_qkv)[0], views(ref_qkv)[0])
    assert torch.equal(views(fused_qkv)[1], views(qkv)[1])


# ----- attention ----------------------------------------------------------------------
def _schedule(requests, block_tables):
    """ScheduledRequests for [(num_computed, num_new)] with the given block tables."""
    return [
        ScheduledRequest(f"r{i}", [5] * new, computed, table, True, GREEDY, 0)
        for i, ((computed, new), table) in enumerate(zip(requests, block_tables))
    ]


def _triton_attention(q, k, v, cache, scheduled, block_size, batch_invariant=False, window=None,
                      softcap=None, sinks=None):
    from kvrecover.ops.triton.attention import TritonPagedAttention, tile_tokens
    from kvrecover.ops.triton.step_inputs import StepInputBuilder

    group = q.shape[1] // k.shape[1]
    builder = StepInputBuilder(block_size, tile_tokens(group), torch.device(DEVICE))
    layout = builder.pack(scheduled)
    inputs = builder.views(layout, builder.upload(layout))
    # batch_invariant: decode on the prefill tiles, else on the fast ones.
    backend = TritonPagedAttention(batch_invariant)
    return backend.forward(q, k, v, cache, inputs.attn, q.shape[-1] ** -0.5, window, softcap,
                           sinks)


def _random_step(requests, block_size, heads, kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    tables, next_block = [], 1
    for computed, new in requests:
        count = -(-(computed + new) // block_size)
        tables.append(list(range(next_block, next_block + count))[::-1])  # non-contiguous order
        next_block += count
    cache = _randn(2, next_block + 2, block_size, kv_heads, head_dim, dtype=dtype, generator=gen)
    total = sum(n for _, n in requests)
    q = _randn(total, heads, head_dim, dtype=dtype, generator=gen)
    k = _randn(total, kv_heads, head_dim, dtype=dtype, generator=gen)
    v = _randn(total, kv_heads, head_dim, dtype=dtype, generator=gen)
    return q, k, v, cache, _schedule(requests, tables)


MIXED_STEP = [(0, 70), (37, 1), (0, 1), (100, 45), (16, 16), (200, 1)]
DECODE_STEP = [(37, 1), (0, 1), (700, 1), (255, 1), (256, 1), (1000, 1)]  # split-context kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("requests", [MIXED_STEP, DECODE_STEP], ids=["mixed", "decode"])
@pytest.mark.parametrize(
    "block_size,heads,kv_heads,head_dim",
    [(16, 8, 2, 32), (13, 4, 4, 16), (16, 12, 4, 64)],
)
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fast", "invariant"])
def test_paged_attention_matches_reference(
    dtype, requests, block_size, heads, kv_heads, head_dim, batch_invariant
):
    from kvrecover.ops.reference.attention_metadata import AttentionMetadata
    from kvrecover.ops.reference.torch_attention import TorchPagedAttention

    q, k, v, cache, scheduled = _random_step(requests, block_size, heads, kv_heads, head_dim, dtype, 0)
    ref_meta = AttentionMetadata.build(
        [s.num_computed_tokens for s in scheduled], [len(s.token_ids) for s in scheduled],
        [s.block_ids for s in scheduled], block_size, torch.device(DEVICE),
    )
    ref_cache = cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, ref_meta, head_dim**-0.5)
    out = _triton_attention(q, k, v, cache, scheduled, block_size, batch_invariant)
    assert torch.equal(cache, ref_cache)  # the same K/V landed in the same slots
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@needs_cuda  # the interpreter's numpy matmul rounds by row position
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_is_batch_and_chunk_invariant(dtype):
    """A request's rows are bit-identical alone, in a batch, in chunks, or as decodes."""
    length, bs = 150, 16
    q, k, v, base, (target,) = _random_step([(0, length)], bs, 8, 2, 32, dtype, 3)
    alone = _triton_attention(q, k, v, base.clone(), [target], bs, batch_invariant=True)

    others_q, others_k, others_v, _, _ = _random_step([(0, 40), (30, 1)], bs, 8, 2, 32, dtype, 4)
    first, second = _schedule([(0, 40), (30, 1)], [[base.shape[1] - 2] * 3, [base.shape[1] - 1] * 2])
    batch = [first, target, second]
    rows = slice(40, 40 + length)
    cat = lambda a, b: torch.cat([b[:40], a, b[40:]])  # noqa: E731
    batched = _triton_attention(
        cat(q, others_q), cat(k, others_k), cat(v, others_v), base.clone(), batch, bs,
        batch_invariant=True,
    )
    assert torch.equal(batched[rows], alone)

    cache = base.clone()
    pieces = []
    for start, end in ((0, 64), (64, 114), (114, 148), (148, 149), (149, 150)):
        step = _schedule([(start, end - start)], [target.block_ids])
        pieces.append(_triton_attention(
            q[start:end], k[start:end], v[start:end], cache, step, bs, batch_invariant=True
        ))
    assert torch.equal(torch.cat(pieces), alone)


# ----- batch-invariant matmul ---------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("n,k", [(2048, 8192), (3072, 2048), (384, 64)])
def test_batch_invariant_linear(n, k):
    from kvrecover.ops.triton.batch_invariant_matmul import linear

    gen = torch.Generator().manual_seed(0)
    x = _randn(1500, k, dtype=torch.bfloat16, generator=gen)
    w = _randn(n, k, dtype=torch.bfloat16, generator=gen) * k**-0.5
    bias = _randn(n, dtype=torch.bfloat16, generator=gen)
    full = linear(x, w, bias)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    assert (full.float() - ref).norm() / ref.norm() < 1e-2
    for rows in (1, 5, 64, 333, 700):
        assert torch.equal(linear(x[:rows], w, bias), full[:rows]), rows
    assert torch.equal(linear(x[-3:], w, bias), full[-3:])


# ----- engine -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gpu_gqa"), num_hidden_layers=2, head_dim=32,
                            num_attention_heads=8, num_key_value_heads=2, hidden_size=128)


@pytest.mark.parametrize("enforce_eager", [True, pytest.param(False, marks=needs_cuda)])
def test_float32_tokens_match_cpu(gqa_model, enforce_eager):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, [1, 9, 40, 130, 17, 64], 384)]
    cpu = LLM(str(gqa_model), device="cpu", max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts, GREEDY)]
    gpu = _make_llm(gqa_model, dtype="float32", max_num_batched_tokens=64, enforce_eager=enforce_eager)
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, GREEDY)]
    assert got == expected


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlapped_decode_matches_eager(gqa_model, dtype):
    """Graph decode steps overlap (step N+1 launched before N's tokens land); requests
    end at different steps, by length and on stop tokens, and outputs do not change."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(7, [1, 9, 40, 130, 17, 64, 5], 384)]
    eager = _make_llm(gqa_model, dtype=dtype, enforce_eager=True, batch_invariant=True)
    free_run = eager.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stops = [o.outputs[0].token_ids[4 + i] for i, o in enumerate(free_run) if i % 2 == 0]
    params = [
        SamplingParams(temperature=0, max_tokens=[1, 40, 2, 33, 40, 8, 40][i], ignore_eos=True,
                       stop_token_ids=stops if i % 2 == 0 else None)
        for i in range(len(prompts))
    ]
    expected = eager.generate(prompts, params)
    graphs = _make_llm(gqa_model, dtype=dtype, batch_invariant=True)
    runner = graphs.engine.model_runner
    launches = []
    launch = runner.launch_decode

    def logged_launch(scheduler_output, previous=None):
        launches.append(previous is not None)
        return launch(scheduler_output, previous)

    runner.launch_decode = logged_launch
    for _ in range(2):
        got = graphs.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
    assert sum(launches) > 20
    assert {o.outputs[0].finish_reason for o in expected} == {"stop", "length"}
    assert not graphs.engine.has_unfinished()


def _decode_logits(llm: LLM, prompts, target: int) -> list[torch.Tensor]:
    """Logits of prompt number `target` at each of its steps, while generating all prompts."""
    runner = llm.engine.model_runner
    target_id = f"{llm._batch_counter}-{target}"
    recorded: list[torch.Tensor] = []
    original_sample = runner._sample

    def sample(logits, sampling, *args):
        ids = [s.request_id for s in sampling]
        if target_id in ids:
            recorded.append(logits[ids.index(target_id)].clone())
        return original_sample(logits, sampling, *args)

    runner._sample = sample
    runner.can_overlap = lambda scheduler_output: False  # overlapped steps skip _sample
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    finally:
        del runner._sample, runner.can_overlap
    return recorded


@needs_cuda
def test_greedy_tokens_match_argmax():
    from kvrecover.ops.triton.sampling import greedy_tokens

    logits = torch.randn(37, 128256, device=DEVICE)
    logits[3, 5000] = logits[3, 70000] = 1e4  # a tie: the first index wins, as in torch
    assert torch.equal(greedy_tokens(logits).long(), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_cuda)])
def test_upcast_greedy_tokens_match_cast_then_argmax(dtype):
    from kvrecover.ops.triton.sampling import upcast_greedy_tokens

    logits = _randn(5, 9000, dtype=dtype, generator=torch.Generator().manual_seed(1))
    logits[2, 100] = logits[2, 8000] = 50.0  # a tie: the first index wins
    upcast, tokens = upcast_greedy_tokens(logits)
    assert upcast.dtype == torch.float32 and torch.equal(upcast, logits.float())
    assert torch.equal(tokens.long(), logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_matches_reference(dtype):
    from kvrecover.ops.triton.fused_ops import TritonOps

    weight = _randn(300, 1100, dtype=dtype, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([5, 0, 299, 5, 17], device=DEVICE)
    assert torch.equal(TritonOps().embedding(ids, weight), weight[ids])
    assert TritonOps().embedding(ids[:0], weight).shape == (0, 1100)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fast", "invariant"])
def test_decode_combine_in_kernel_is_bit_identical(dtype, batch_invariant):
    """The last program's in-kernel merge gives the combine kernel's bits, and leaves
    every arrival counter at zero for the next launch (two launches, same bits)."""
    import dataclasses

    from kvrecover.ops.triton import attention as ta
    from kvrecover.ops.triton.arrival import all_counters_zero
    from kvrecover.ops.triton.step_inputs import StepInputBuilder

    q, k, v, cache, scheduled = _random_step(DECODE_STEP, 16, 12, 4, 64, dtype, 5)
    builder = StepInputBuilder(16, ta.tile_tokens(3), torch.device(DEVICE))
    layout = builder.pack(scheduled)
    meta = builder.views(layout, builder.upload(layout)).attn
    ta.store_kv(k, v, cache, meta.slot_mapping)
    base = ta.INVARIANT_DECODE if batch_invariant else ta.FAST_DECODE
    separate = ta.paged_attention(q, cache, meta, 0.125,
                                  decode=dataclasses.replace(base, fused_combine=False))
    for _ in range(2):
        fused = ta.paged_attention(q, cache, meta, 0.125,
                                   decode=dataclasses.replace(base, fused_combine=True))
        assert torch.equal(fused, separate)
        assert all_counters_zero(q.device)


def _decode_step_and_reference(requests, seed):
    """A float32 decode step (block 16, 8 heads over 2 KV heads of 32 dims): its query, the
    cache with the step's keys stored, the Triton metadata and the torch reference output."""
    from kvrecover.ops.reference.attention_metadata import AttentionMetadata
    from kvrecover.ops.reference.torch_attention import TorchPagedAttention
    from kvrecover.ops.triton import attention as ta
    from kvrecover.ops.triton.step_inputs import StepInputBuilder

    q, k, v, cache, scheduled = _random_step(requests, 16, 8, 2, 32, torch.float32, seed)
    ref_meta = AttentionMetadata.build(
        [s.num_computed_tokens for s in scheduled], [1] * len(scheduled),
        [s.block_ids for s in scheduled], 16, torch.device(DEVICE),
    )
    ref = TorchPagedAttention().forward(q, k, v, cache.clone(), ref_meta, 32**-0.5)
    builder = StepInputBuilder(16, ta.tile_tokens(4), torch.device(DEVICE))
    layout = builder.pack(scheduled)
    meta = builder.views(layout, builder.upload(layout)).attn
    ta.store_kv(k, v, cache, meta.slot_mapping)
    return q, cache, meta, ref


@pytest.mark.parametrize("segment,block_n,fused", [(128, 32, True), (512, 128, False)])
def test_decode_segment_sizes_match_reference(segment, block_n, fused):
    """Other decode segment sizes (default mode only) compute the same attention."""
    import dataclasses

    from kvrecover.ops.triton import attention as ta

    q, cache, meta, ref = _decode_step_and_reference(DECODE_STEP, 6)
    config = dataclasses.replace(ta.FAST_DECODE, segment=segment, block_n=block_n,
                                 fused_combine=fused)
    out = ta.paged_attention(q, cache, meta, 32**-0.5, decode=config)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("target_programs", [12, 24, 60])
def test_decode_programs_merging_their_own_segments_match_reference(target_programs):
    """FAST_DECODE's programs each merge several segments before the last one merges a
    state per program (12, 24 and 60 target programs for 6 requests x 2 KV heads: 1, 2
    or 5 programs a token over up to 63 segments): the reference's attention, the same
    bits on a second launch, every arrival counter back at zero."""
    import dataclasses

    from kvrecover.ops.triton import attention as ta
    from kvrecover.ops.triton.arrival import all_counters_zero

    long_step = [(37, 1), (0, 1), (2000, 1), (255, 1), (256, 1), (1000, 1)]
    q, cache, meta, ref = _decode_step_and_reference(long_step, 7)
    config = dataclasses.replace(ta.FAST_DECODE, segment=32, block_n=32,
                                 target_programs=target_programs)
    assert config.merge_in_program and config.fused_combine
    first = ta.paged_attention(q, cache, meta, 32**-0.5, decode=config)
    torch.testing.assert_close(first, ref, rtol=2e-5, atol=2e-5)
    assert torch.equal(ta.paged_attention(q, cache, meta, 32**-0.5, decode=config), first)
    assert all_counters_zero(q.device)


def test_decode_pack_matches_generic_pack():
    """The graph path's cached decode packing writes what the generic packing writes."""
    import random

    from kvrecover.ops.triton.step_inputs import StepInputBuilder

    rng = random.Random(0)
    fast, ref = (StepInputBuilder(16, 32, torch.device("cpu"), 1168) for _ in range(2))
    requests = {f"r{i}": [rng.randint(1, 50), [rng.randint(1, 999)]] for i in range(20)}
    for step in range(200):
        if rng.random() < 0.1 and len(requests) > 3:
            requests.pop(rng.choice(sorted(requests)))
        names = sorted(requests)[: rng.choice([len(requests), max(1, len(requests) - 2)])]
        scheduled = []
        for name in names:
            position, blocks = requests[name]
            while len(blocks) * 16 <= position:
                blocks.append(rng.randint(1, 999))
            scheduled.append(ScheduledRequest(name, [rng.randint(0, 99)], position, list(blocks),
                                              False, GREEDY, 0))
            requests[name][0] += 1
        if rng.random() < 0.05:
            fast.pack(scheduled)  # an eager step in between
        bucket = 32 if len(scheduled) > 16 else 16
        got = fast.pack(scheduled, pad_to=bucket)
        padding = [ScheduledRequest("pad", [0], 0, [0], False, GREEDY, 0)] * (bucket - len(scheduled))
        want = ref.pack(scheduled + padding)
        assert got.offsets == want.offsets
        for name, offset in got.offsets.items():
            span = slice(offset, offset + got.lengths[name])
            assert (fast._host_np[span] == ref._host_np[span]).all(), (step, name)


@needs_cuda
def test_bf16_batch_invariant_mode_is_exact(gqa_model):
    """Same logits bits for one request alone (eager, big chunks) and batched (graphs, small chunks)."""
    prompts = random_prompts(5, [600, 3, 77, 250, 31], 384, seed=4)
    alone = _make_llm(gqa_model, dtype="bfloat16", batch_invariant=True, enforce_eager=True,
                      max_num_batched_tokens=2048)
    expected = _decode_logits(alone, [prompts[0]], 0)
    batched = _make_llm(gqa_model, dtype="bfloat16", batch_invariant=True,
                        max_num_batched_tokens=96)
    got = _decode_logits(batched, prompts, 0)
    assert len(got) == len(expected) == GREEDY.max_tokens
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), step


@needs_cuda
def test_bf16_logits_close_to_hf(gqa_model):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(1, [200], 384, seed=7)[0]
    llm = _make_llm(gqa_model, dtype="bfloat16", enforce_eager=True)
    ours = _decode_logits(llm, [prompt], 0)[0]
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.no_grad():
        hf32 = AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.float32).to(DEVICE)
        ref = hf32(ids).logits[0, -1].float()
        hf16 = AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.bfloat16).to(DEVICE)
        hf_bf16 = hf16(ids).logits[0, -1].float()
    ours_err = (ours - ref).norm() / ref.norm()
    hf_err = (hf_bf16 - ref).norm() / ref.norm()
    assert ours_err < max(2 * hf_err, 1e-2), (ours_err, hf_err)
