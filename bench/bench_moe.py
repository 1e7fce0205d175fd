"""GPU benchmark of the mixture-of-experts path on a Qwen3-30B-A3B-shaped model (random bf16).

Three parts:
- `layer`: one MoE layer (128 experts of 768, top-8, hidden 2048) at decode and
  prefill token counts: the fused Triton MoE (default tiles and the fixed
  batch-invariant ones) against `torch._grouped_mm` (where it runs), each with the
  bytes of the *active* experts it must read and the share of the measured copy
  bandwidth (decode) or of the bf16 matmul rate (prefill) it reaches;
- `align`: the MoE align (the assignments sorted by expert) in torch against its
  one-launch Triton kernel, graph-replayed, at decode token counts;
- `engine`: kvrecover end to end on a random checkpoint of the same shape with
  `--layers` of its 48 layers (the whole model needs 61 GB of disk): decode tok/s
  at batch 1/16/64 and prefill tok/s, default (batch-invariant for MoE models), `fast`
  (the non-invariant tiles), and fast with the experts on `torch._grouped_mm`
  (patched in here only, to compare), with the
  roofline of a decode step from the bytes of the active parameters it reads
  (every dense weight, the expected distinct experts of the batch under uniform
  routing, the KV of the batch).

    PYTHONPATH=. python bench/bench_moe.py [--parts layer engine align] [--layers 8]
        [--batches 1 16 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from functools import partial
from pathlib import Path

import torch
from bench_gpu import _rates, _time_cuda, device_ceilings

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
)
BF16 = 2  # bytes


def expert_bytes() -> int:
    """Bytes of one expert's three projections."""
    return 3 * QWEN3_30B_A3B["hidden_size"] * QWEN3_30B_A3B["moe_intermediate_size"] * BF16


def expected_active_experts(tokens: int) -> float:
    """Distinct experts `tokens` tokens hit under uniform top-k routing."""
    experts, top_k = QWEN3_30B_A3B["num_experts"], QWEN3_30B_A3B["num_experts_per_tok"]
    return experts * (1 - (1 - top_k / experts) ** tokens)


# ----- one layer ----------------------------------------------------------------------
def layer_bench(ceilings: dict, token_counts: list[int]) -> list[dict]:
    """Times one MoE layer's experts (routing included) per implementation and token count."""
    from kvrecover.models.moe import ExpertWeights, route_topk
    from kvrecover.ops.reference.grouped_moe import grouped_mm_available, grouped_mm_moe
    from kvrecover.ops.triton.batch_invariant_matmul import linear as invariant_linear
    from kvrecover.ops.triton.fused_ops import TritonOps
    from kvrecover.ops.triton.moe import fused_moe

    c = QWEN3_30B_A3B
    hidden, inter, experts_n, top_k = (c["hidden_size"], c["moe_intermediate_size"],
                                       c["num_experts"], c["num_experts_per_tok"])
    with torch.device("cuda"):
        experts = ExpertWeights(experts_n, hidden, inter).to(torch.bfloat16)
        torch.nn.init.normal_(experts.gate_up_proj, std=hidden**-0.5)
        torch.nn.init.normal_(experts.down_proj, std=inter**-0.5)
        router = torch.randn(experts_n, hidden, dtype=torch.bfloat16) * hidden**-0.5
    silu_mul = TritonOps.silu_mul

    def implementations(x: torch.Tensor) -> dict:
        impls = {
            "triton": lambda: fused_moe(x, *route_topk(x @ router.T, top_k, True), experts),
            "triton_invariant": lambda: fused_moe(
                x, *route_topk(invariant_linear(x, router), top_k, True), experts,
                batch_invariant=True),
        }
        if grouped_mm_available(x):
            impls["grouped_mm"] = lambda: grouped_mm_moe(
                x, *route_topk(x @ router.T, top_k, True), experts, silu_mul)
        return impls

    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        impls = implementations(x)
        active = route_topk(x @ router.T, top_k, True)[1].unique().numel()
        active_bytes = active * expert_bytes()
        flops = 2 * tokens * top_k * 3 * hidden * inter
        for name, fn in impls.items():
            with torch.inference_mode():
                seconds = _time_cuda(fn, 20, inner=5)
            row = {"part": "layer", "impl": name, "tokens": tokens, "us": seconds * 1e6,
                   "active_experts": active, "active_GB": active_bytes / 1e9,
                   "GB_s": active_bytes / seconds / 1e9,
                   "pct_copy_roofline": 100 * active_bytes / seconds / ceilings["copy_bytes_per_s"],
                   "TFLOP_s": flops / seconds / 1e12,
                   "pct_matmul_peak": 100 * flops / seconds / ceilings["matmul_flop_per_s"]}
            rows.append(row)
            print(f"layer  {name:17s} T={tokens:5d}  {row['us']:9.1f} us  "
                  f"{active:3d} experts  {row['GB_s']:7.0f} GB/s ({row['pct_copy_roofline']:4.1f}% "
                  f"of copy)  {row['TFLOP_s']:6.1f} TFLOP/s ({row['pct_matmul_peak']:4.1f}%)",
                  flush=True)
    return rows


# ----- the engine ---------------------------------------------------------------------
def build_checkpoint(folder: Path, layers: int) -> Path:
    """A random bf16 Qwen3-30B-A3B-shaped checkpoint with `layers` layers and a word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").is_file() and \
            json.loads((folder / "config.json").read_text())["num_hidden_layers"] == layers:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    fields = {k: v for k, v in QWEN3_30B_A3B.items() if k != "architectures"}
    config = AutoConfig.for_model(**{**fields, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(QWEN3_30B_A3B["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t151645"}))
    del model
    torch.cuda.empty_cache()
    return folder


def decode_roofline(ceilings: dict, layers: int, batch: int, context: int) -> float:
    """Seconds a decode step needs at copy bandwidth: the dense weights, the batch's
    distinct experts per layer and its KV, each read once."""
    c = QWEN3_30B_A3B
    hidden, heads, kv_heads, head_dim = (c["hidden_size"], c["num_attention_heads"],
                                         c["num_key_value_heads"], c["head_dim"])
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    router = c["num_experts"] * hidden
    dense = layers * (attention + router) * BF16 + c["vocab_size"] * hidden * BF16  # LM head
    experts = layers * expected_active_experts(batch) * expert_bytes()
    kv = layers * batch * context * 2 * kv_heads * head_dim * BF16
    return (dense + experts + kv) / ceilings["copy_bytes_per_s"]


def time_engine(model_dir: Path, batch: int, prompt_len: int, new_tokens: int,
                grouped_mm: bool = False, fast_tiles: bool = False, **llm_args) -> dict:
    """Prefill and decode rates of one batch shape (after a warm-up run). `fast_tiles`:
    the non-invariant kernels MoE models no longer run by default."""
    from kvrecover import LLM, SamplingParams
    from kvrecover.ops import backend
    from kvrecover.ops.reference.grouped_moe import grouped_mm_moe
    from kvrecover.ops.triton.fused_ops import TritonOps

    original = TritonOps.moe
    backend.MOE_INVARIANT_BY_DEFAULT = not fast_tiles
    if grouped_mm:  # the comparison only: the engine's experts on torch._grouped_mm
        TritonOps.moe = lambda self, x, w, ids, experts: grouped_mm_moe(  # type: ignore
            x, w, ids, experts, self.silu_mul)
    try:
        llm = LLM(str(model_dir), device="cuda:0", dtype="bfloat16",
                  max_model_len=prompt_len + new_tokens + 16, enable_prefix_caching=False,
                  kv_cache_memory_gb=8, max_num_seqs=max(batch, 16), **llm_args)
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def run(seed: int, sampling: SamplingParams) -> float:
            generator = torch.Generator().manual_seed(seed)
            prompts = torch.randint(10, 150000, (batch, prompt_len), generator=generator).tolist()
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        run(1, params)  # warm-up: compiles the kernels, captures the graphs
        prefill_s = min(run(2 + i, first) for i in range(3))
        total_s = run(9, params)
        return _rates(batch, prompt_len, new_tokens, prefill_s, total_s)
    finally:
        TritonOps.moe = original  # type: ignore[method-assign]
        backend.MOE_INVARIANT_BY_DEFAULT = True
        gc.collect()
        torch.cuda.empty_cache()


def engine_bench(ceilings: dict, args: argparse.Namespace) -> list[dict]:
    model_dir = build_checkpoint(args.model_dir, args.layers)
    # "default" is batch-invariant for MoE models (ops.backend.MOE_INVARIANT_BY_DEFAULT);
    # "fast" and "grouped_mm" run the faster non-invariant kernels.
    modes = {"default": {}, "fast": {"fast_tiles": True},
             "grouped_mm": {"grouped_mm": True, "fast_tiles": True}}
    rows = []
    for batch in args.batches:
        roof_s = decode_roofline(ceilings, args.layers, batch, args.prompt_len + args.new_tokens // 2)
        for mode in args.modes:
            result = time_engine(model_dir, batch, args.prompt_len, args.new_tokens, **modes[mode])
            step_s = batch / result["decode_tok_s"]
            row = {"part": "engine", "mode": mode, "batch": batch, "layers": args.layers,
                   **result, "decode_roofline_ms": roof_s * 1e3,
                   "pct_decode_roofline": 100 * roof_s / step_s}
            rows.append(row)
            print(f"engine {mode:15s} batch {batch:3d}  decode {result['decode_tok_s']:8.0f} tok/s "
                  f"({row['pct_decode_roofline']:4.1f}% of the active-bytes roofline, "
                  f"{roof_s * 1e3:.2f} ms/step)  prefill {result['prefill_tok_s']:8.0f} tok/s",
                  flush=True)
    return rows


ALIGN_CASES = [(1, 10, 512), (16, 10, 512), (64, 10, 512), (16, 8, 128), (256, 8, 128)]


def align_bench() -> list[dict]:
    """The MoE align (assignments sorted by expert into row blocks) in torch against the
    one-launch Triton kernel, graph-replayed (`do_bench_cudagraph`), (tokens, top-k,
    experts) of Qwen3-Next (10 of 512) and Qwen3-30B (8 of 128); their blocks compared."""
    import triton.testing

    from kvrecover.ops.reference.grouped_moe import align_by_expert
    from kvrecover.ops.triton.moe_align import align_by_expert_triton

    rows = []
    for tokens, top_k, experts in ALIGN_CASES:
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
        ours, reference = (align_by_expert_triton(ids, experts, 16),
                           align_by_expert(ids, experts, 16))
        same = (torch.equal(ours.sorted_ids, reference.sorted_ids)
                and torch.equal(ours.block_expert, reference.block_expert))
        torch_us, triton_us = (
            triton.testing.do_bench_cudagraph(partial(align, ids, experts, 16)) * 1e3
            for align in (align_by_expert, align_by_expert_triton))
        print(f"align T={tokens} k={top_k} E={experts}: torch {torch_us:.1f} us, "
              f"triton {triton_us:.1f} us, same blocks: {same}", flush=True)
        rows.append({"part": "align", "tokens": tokens, "top_k": top_k, "experts": experts,
                     "torch_us": torch_us, "triton_us": triton_us, "same": same})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["layer", "engine"],
                        choices=["layer", "engine", "align"])
    parser.add_argument("--layers", type=int, default=8, help="of the model's 48 (disk, time)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--layer-tokens", type=int, nargs="+", default=[1, 16, 64, 512, 4096])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=["default", "fast", "grouped_mm"])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/kvrecover-bench-qwen3moe"))
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args()

    ceilings = device_ceilings()
    print(f"device: {torch.cuda.get_device_name()}  copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} "
          f"TB/s  bf16 matmul {ceilings['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []
    if "layer" in args.parts:
        rows += layer_bench(ceilings, args.layer_tokens)
    if "engine" in args.parts:
        rows += engine_bench(ceilings, args)
    if "align" in args.parts:
        rows += align_bench()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"ceilings": ceilings, "runs": rows},
                                                          indent=1))


if __name__ == "__main__":
    main()
