"""Hybrid (Qwen3-Next) prefill and decode throughput, issue 23's GPU figure: the Gated
DeltaNet layers on the torch reference (one call per request, Python chunk loop) against
the batched Triton kernels (`ops/triton/gated_delta.py`, `ops/triton/causal_conv.py`),
eager and with CUDA-graphed decode steps, same engine, same random checkpoint, same run.

    PYTHONPATH=. python bench/bench_hybrid_gpu.py --device cuda [--batches 1 16]
        [--prompt-tokens 1024 4096] [--new-tokens 64] [--batch-invariant]
        [--implementations "torch reference" "triton eager" "triton graphs"]
    PYTHONPATH=.:/work/triton_site TRITON_INTERPRET=1 python bench/bench_hybrid_gpu.py \
        --device cpu --tiny            # proves the script on a CPU (Triton's interpreter)

The checkpoint (random bf16, written once to --model-dir): Qwen3-Next-80B-A3B's layer
shapes, 4 of its 48 layers (3 Gated DeltaNet + 1 gated full attention) and 64 of its
512 experts (10 per token), as bench/NOTES.md's "Qwen3-Next on the H200". `--tiny`: a
float32 model of the same layout with small dims. Prefill tok/s = batch x prompt / time
to the batch's first tokens; decode tok/s = batch x (new - 1) / the rest (best of
--repeats, after a warm-up run); the tokens of both implementations are compared. On
the GPU, decode is also given as a share of its roofline: the bytes a step must move
(`decode_step_bytes`: weights, the experts routed to, KV, recurrent states read and
written) at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_recovery import release_memory, timed_batch
from model_shapes import write_word_tokenizer
from random_checkpoint import write_random_checkpoint

from kvrecover import LLM
from kvrecover.ops.reference.torch_ops import TorchOps
from kvrecover.ops.triton.interpreter_compat import patch_scalar_index

LAYOUT = dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
              full_attention_interval=4, decoder_sparse_step=1, bos_token_id=0, eos_token_id=1,
              tie_word_embeddings=False, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
QWEN3_NEXT_80B = dict(**LAYOUT, vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                      partial_rotary_factor=0.25, rope_theta=10_000_000.0,
                      max_position_embeddings=32768, linear_num_key_heads=16,
                      linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, num_experts=64, num_experts_per_tok=10,
                      moe_intermediate_size=512, shared_expert_intermediate_size=512)
TINY = dict(**LAYOUT, vocab_size=512, hidden_size=64, intermediate_size=96,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=4096, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# The reference cannot run inside a CUDA graph (its per-request loop is host code): eager.
IMPLEMENTATIONS = ("torch reference", "triton eager", "triton graphs")


@dataclass
class Row:
    """One implementation at one batch shape."""

    implementation: str
    batch: int
    prompt_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    outputs: list[list[int]]


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Seeded prompts of ids in [2, vocab_size) (no bos/eos)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (count, length), generator=generator).tolist()


def write_model(folder: Path, tiny: bool, device: str) -> Path:
    """The random checkpoint (kept in `folder` for later runs)."""
    if not (folder / "model.safetensors.index.json").is_file() and not (
            folder / "model.safetensors").is_file():
        config = TINY if tiny else QWEN3_NEXT_80B
        write_random_checkpoint(config, folder, dtype="float32" if tiny else "bfloat16",
                                device=device)
        write_word_tokenizer(folder, config["vocab_size"], config["eos_token_id"])
    return folder


def decode_step_bytes(model_dir: Path, batch: int, context: int) -> dict[str, float]:
    """The bytes one decode step of `batch` requests at `context` tokens must move, by
    kind: every weight but the embedding once (the LM head included), the experts a batch
    routes to (the expected number of distinct ones, at uniform routing), the full-attention
    layers' KV, and each Gated DeltaNet layer's recurrent state read and written (float32)
    with its conv state: the minimum of a recurrent decode kernel."""
    import json

    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    weights = expert_bytes = 0.0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as tensors:
            for name in tensors.keys():
                part = tensors.get_slice(name)
                count = 1
                for size in part.get_shape():
                    count *= size
                nbytes = count * (4 if part.get_dtype() in ("F32", "float32") else 2)
                if "embed_tokens" in name:
                    continue
                if ".mlp.experts." in name:
                    expert_bytes += nbytes
                else:
                    weights += nbytes
    routed = experts * (1 - (1 - top_k / experts) ** batch)  # distinct experts a layer reads
    layer_types = config["layer_types"]
    full = layer_types.count("full_attention")
    linear = layer_types.count("linear_attention")
    kv = 2 * 2 * config["num_key_value_heads"] * config["head_dim"] * full * context * batch
    heads_v, dk, dv = (config["linear_num_value_heads"], config["linear_key_head_dim"],
                       config["linear_value_head_dim"])
    conv_dim = 2 * config["linear_num_key_heads"] * dk + heads_v * dv
    state = linear * batch * (2 * 4 * heads_v * dk * dv
                              + 2 * 2 * conv_dim * (config["linear_conv_kernel_dim"] - 1))
    return {"weights": weights, "experts": expert_bytes * routed / experts, "kv": kv,
            "state": state}


def use_reference_linear_layers(llm: LLM) -> None:
    """Route the engine's Gated DeltaNet layers through the torch reference (per request),
    as the Triton backend ran them before its kernels existed."""
    ops = llm.engine.model_runner.backend.ops
    for name in ("causal_conv1d_batch", "gated_delta_rule_batch"):
        setattr(ops, name, functools.partial(getattr(TorchOps, name), ops))


def measure(model_dir: Path, implementation: str, batch: int, prompt_tokens: int,
            args: argparse.Namespace) -> Row:
    """Warm-up (compiles), then the best of `--repeats` fresh batches."""
    device = "cuda:0" if args.device == "cuda" else "cpu"
    llm = LLM(str(model_dir), device=device, dtype="float32" if args.tiny else "bfloat16",
              attention_backend="triton", max_model_len=prompt_tokens + args.new_tokens + 16,
              enable_prefix_caching=False, max_num_seqs=max(batch, 16),
              max_num_batched_tokens=args.chunk_tokens, block_size=args.block_size,
              batch_invariant=args.batch_invariant,
              enforce_eager=implementation != "triton graphs")
    if implementation == "torch reference":
        use_reference_linear_layers(llm)
    vocab_size = (TINY if args.tiny else QWEN3_NEXT_80B)["vocab_size"]
    timed_batch(llm, random_prompts(batch, prompt_tokens, vocab_size, 1), args.new_tokens)
    best_prefill = best_decode = float("inf")
    outputs: list[list[int]] = []
    for repeat in range(args.repeats):
        produced: list[list[int]] = []
        if args.device == "cuda":
            torch.cuda.synchronize()
        prompts = random_prompts(batch, prompt_tokens, vocab_size, 2 + repeat)
        ttft, _, total = timed_batch(llm, prompts, args.new_tokens, produced)
        best_prefill, best_decode = min(best_prefill, ttft), min(best_decode, total - ttft)
        outputs = outputs or produced
    graphs = llm.engine.model_runner.graphs
    if implementation == "triton graphs":
        print(f"decode graphs captured for batch sizes {sorted(graphs.graphs) if graphs else []}")
    llm.close()
    del llm
    release_memory()
    return Row(implementation, batch, prompt_tokens, batch * prompt_tokens / best_prefill,
               batch * (args.new_tokens - 1) / best_decode, outputs)


def print_table(rows: list[Row], args: argparse.Namespace, model_dir: Path,
                copy_bytes_per_s: float | None) -> None:
    print(f"\nQwen3-Next {'tiny float32' if args.tiny else '80B-A3B shape, 4 layers, bf16'} on "
          f"{args.device}, block {args.block_size}, chunk {args.chunk_tokens}, "
          f"{args.new_tokens} new tokens, best of {args.repeats}, batch_invariant "
          f"{args.batch_invariant}")
    print("\n| batch | prompt | linear layers | prefill tok/s | decode tok/s | decode % of "
          "roofline | tokens equal |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for row in rows:
        base = next(r for r in rows if r.batch == row.batch and r.prompt_tokens ==
                    row.prompt_tokens and r.implementation == args.implementations[0])
        roof = float("nan")
        if copy_bytes_per_s:
            step = decode_step_bytes(model_dir, row.batch,
                                     row.prompt_tokens + args.new_tokens // 2)
            roof = 100 * row.decode_tok_s / (row.batch * copy_bytes_per_s / sum(step.values()))
        print(f"| {row.batch} | {row.prompt_tokens} | {row.implementation} | "
              f"{row.prefill_tok_s:,.0f} | {row.decode_tok_s:,.1f} | {roof:.1f} | "
              f"{row.outputs == base.outputs} |")
        if row is not base:
            print(f"| | | ratio / {base.implementation} | {row.prefill_tok_s / base.prefill_tok_s:.2f}x"
                  f" | {row.decode_tok_s / base.decode_tok_s:.2f}x | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small float32 dims (CPU check)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=8192,
                        help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS,
                        default=list(IMPLEMENTATIONS), help="the first is the ratios' base")
    args = parser.parse_args()
    logging.getLogger("kvrecover").setLevel(logging.ERROR)
    if os.environ.get("TRITON_INTERPRET") == "1":
        patch_scalar_index()
    model_dir = args.model_dir or Path(
        "/tmp/kvrecover-bench-qwen3-next" + ("-tiny" if args.tiny else ""))
    write_model(model_dir, args.tiny, "cuda" if args.device == "cuda" else "cpu")
    rows = []
    for batch in args.batches:
        for prompt_tokens in args.prompt_tokens:
            for implementation in args.implementations:
                started = time.perf_counter()
                rows.append(measure(model_dir, implementation, batch, prompt_tokens, args))
                print(f"{implementation}, batch {batch} x {prompt_tokens}: "
                      f"{time.perf_counter() - started:.1f} s", flush=True)
    copy_bytes_per_s = None
    if args.device == "cuda":
        from bench_gpu import device_ceilings

        copy_bytes_per_s = device_ceilings()["copy_bytes_per_s"]
        for batch in args.batches:
            step = decode_step_bytes(model_dir, batch, args.prompt_tokens[0] + args.new_tokens // 2)
            print(f"decode step bytes, batch {batch} x {args.prompt_tokens[0]}: " + ", ".join(
                f"{kind} {nbytes / 1e6:,.0f} MB" for kind, nbytes in step.items()))
    print_table(rows, args, model_dir, copy_bytes_per_s)


if __name__ == "__main__":
    main()
