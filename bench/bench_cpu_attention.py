"""CPU prefill attention alone, in GFLOP/s: our C kernel and torch SDPA (the float32 path).

Command (repository root):

    PYTHONPATH=. .venv/bin/python bench/bench_cpu_attention.py --threads 1 \
        --cells 2x1024 8x256 1x128 --dtypes bfloat16 float32

Per cell (requests x prompt tokens, fresh causal prompts, SmolLM2-135M's heads by default:
9 query heads, 3 KV heads, head_dim 64, block size 16, a cache scattered over blocks) it
times one layer's attention call (the step's K/V written into the cache, then attention)
for `NativeInvariantAttention` (the bf16 default, and float32 decode) and
`TorchPagedAttention` without its decode kernel (SDPA: float32 prefill), best of
`--repeats`, and prints the milliseconds and GFLOP/s counted as 4 * head_dim * query heads
* (keys each query sees), summed.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvrecover.ops.cpu.attention import native_cpu_attention
from kvrecover.ops.reference.attention_metadata import AttentionMetadata
from kvrecover.ops.reference.torch_attention import TorchPagedAttention

CPU = torch.device("cpu")


def attention_flops(num_requests: int, prompt: int, heads: int, head_dim: int) -> float:
    """Multiply-adds of QK^T and PV, times 2, for causal prompts of `prompt` tokens."""
    keys_seen = num_requests * prompt * (prompt + 1) // 2
    return 4.0 * head_dim * heads * keys_seen


def time_call(call, repeats: int) -> float:
    """Best wall time of `call()` over `repeats` runs after one warm-up, in seconds."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=["2x1024", "8x256", "1x128"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = native_cpu_attention()
    if native is None:
        raise SystemExit("the C kernel did not build")
    sdpa = TorchPagedAttention()
    generator = torch.Generator().manual_seed(0)
    print(f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, block {args.block_size}, "
          f"threads {args.threads}, best of {args.repeats}")
    print(f"{'cell':>10} {'dtype':>9} {'kernel':>7} {'ms':>9} {'GFLOP/s':>8}")
    for cell in args.cells:
        num_requests, prompt = (int(part) for part in cell.split("x"))
        blocks_each = -(-prompt // args.block_size)
        num_blocks = num_requests * blocks_each + 1
        order = torch.randperm(num_blocks - 1, generator=generator) + 1
        tables = [order[r * blocks_each : (r + 1) * blocks_each].tolist()
                  for r in range(num_requests)]
        meta = AttentionMetadata.build([0] * num_requests, [prompt] * num_requests, tables,
                                       args.block_size, CPU)
        flops = attention_flops(num_requests, prompt, args.heads, args.head_dim)
        tokens = num_requests * prompt
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            q = torch.randn(tokens, args.heads, args.head_dim, generator=generator).to(dtype)
            k, v = (torch.randn(tokens, args.kv_heads, args.head_dim,
                                generator=generator).to(dtype) for _ in range(2))
            cache = torch.zeros(2, num_blocks, args.block_size, args.kv_heads, args.head_dim,
                                dtype=dtype)
            scale = args.head_dim**-0.5
            kernels = [("C", native)] + ([("SDPA", sdpa)] if dtype == torch.float32 else [])
            for name, kernel in kernels:
                inputs = (q, k, v, cache, meta, scale)
                seconds = time_call(lambda kernel=kernel, inputs=inputs: kernel.forward(*inputs),
                                    args.repeats)
                print(f"{cell:>10} {dtype_name:>9} {name:>7} {seconds * 1e3:9.2f} "
                      f"{flops / seconds / 1e9:8.1f}")


if __name__ == "__main__":
    main()
