"""Where a graph-replayed decode step's time goes, and what each kernel achieves.

At bench_gpu.py's shape (Llama-3.2-1B, random bf16 weights, prompts of 1024):
- the per-kernel table of about 20 decode steps (torch profiler over the engine's
  graph replays): name, launches and microseconds per step, share of the step;
- the same forward run eagerly (a check on the graph table);
- each linear (cuBLAS) and the attention kernel alone, graph-timed over the 16
  layers' real weights and caches: microseconds and bytes/s against the copy
  ceiling, for the current and other decode attention configs;
- the small ops alone, with other warp counts;
- the host side of steady engine steps (section `host`): wall per step, and under
  cProfile the functions with the most own time per step (waits for the device
  included, e.g. `synchronize`), to find what is not hidden behind the device.

    PYTHONPATH=. python3 bench/profile_gpu_decode.py [--batches 16 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import _time_cuda, device_ceilings, random_prompts  # noqa: E402
from model_shapes import ModelShape, build_checkpoint  # noqa: E402

ALL = 1 << 20  # target programs: one program per segment
# Decode attention variants against FAST_DECODE: (label, DecodeKernelConfig fields).
ATTENTION = [
    ("separate combine", dict(fused_combine=False)),
    ("a state per segment", dict(merge_in_program=False)),
    ("all", dict(target_programs=ALL)),
    ("bn128 st3", dict(block_n=128, num_stages=3)),
    ("w2 st3 all", dict(num_warps=2, num_stages=3, target_programs=ALL)),
    ("st4 all", dict(num_stages=4, target_programs=ALL)),
    ("seg128 all", dict(segment=128, target_programs=ALL)),
    ("seg512 bn128 st3 all", dict(segment=512, block_n=128, num_stages=3, target_programs=ALL)),
    ("seg512 bn128 w8 st3 all", dict(segment=512, block_n=128, num_warps=8, num_stages=3,
                                     target_programs=ALL)),
    ("seg1024 bn128 st3 all", dict(segment=1024, block_n=128, num_stages=3, target_programs=ALL)),
]
INVARIANT = [
    ("invariant fused", dict(fused_combine=True)),
    ("invariant fused all", dict(fused_combine=True, target_programs=ALL)),
    ("invariant separate all", dict(fused_combine=False, target_programs=ALL)),
    ("invariant fused st3", dict(fused_combine=True, num_stages=3)),
]


def graph_time(calls: list, reps: int = 20) -> float:
    """Seconds per call of the callables, captured back to back in one CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    seconds = _time_cuda(graph.replay, reps) / len(calls)
    del graph
    return seconds


def _device_us(event) -> float:
    for name in ("device_time_total", "cuda_time_total", "self_device_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def kernel_table(engine, steps: int) -> list[dict]:
    """Per-kernel launches and microseconds per step over `steps` engine steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return _per_step_rows(prof, steps)


def _per_step_rows(prof, steps: int) -> list[dict]:
    """The profiled kernels per step (name, launches, device us, share), slowest first."""
    rows = [
        {"name": e.key, "count": e.count / steps, "us": _device_us(e) / steps}
        for e in prof.key_averages() if _device_us(e) > 0
    ]
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    for r in rows:
        r["pct"] = 100 * r["us"] / total
    return rows


@torch.inference_mode()
def eager_table(engine, batch: int, steps: int) -> list[dict]:
    """`kernel_table` of the graphed forward run eagerly on the running requests' inputs
    (the same kernels; a check on the graph table, where the profiler misses graph kernels)."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.model_runner
    graphs = runner.graphs
    layout = graphs.builder.pack(decode_step(engine), pad_to=graphs.bucket(batch))
    graphs.builder.upload(layout, graphs.buffer)
    inputs = graphs.builder.views(layout, graphs.buffer)
    runner._decode_step(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner._decode_step(inputs)
        torch.cuda.synchronize()
    return _per_step_rows(prof, steps)


def decode_step(engine) -> list:
    """A one-token step of every running request (what the next decode step reads)."""
    from kvrecover.step_messages import ScheduledRequest

    return [ScheduledRequest(r.request_id, [0], r.num_tokens - 1, list(r.block_ids), True, None, 0)
            for r in engine.scheduler.running]


def start_decoding(llm, batch: int, prompt_len: int):
    """Add `batch` prompts and step until every request is past prefill and graphs are warm."""
    from kvrecover import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, 30)):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(400):
        engine.step()
        running = engine.scheduler.running
        if len(running) == batch and min(len(r.output_token_ids) for r in running) >= 6:
            break
    torch.cuda.synchronize()
    return engine


@torch.inference_mode()
def host_profile(engine, steps: int) -> list[dict]:
    """Wall per engine step in steady decode, then the top own-time functions per step
    under cProfile (which slows Python: compare its wall with the plain one)."""
    import cProfile
    import pstats
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    rows = [{"name": "wall per step, plain", "us": 1e6 * (time.perf_counter() - start) / steps}]
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    rows.append({"name": "wall per step, cProfile", "us": 1e6 * (time.perf_counter() - start) / steps})
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    own = sorted(((tottime, key) for key, (_, _, tottime, _, _) in stats.items()), reverse=True)
    for tottime, (file, line, name) in own[:25]:
        rows.append({"name": f"{Path(file).name}:{line} {name}", "us": 1e6 * tottime / steps})
    return rows


def linears(runner, batch: int, copy_bw: float) -> list[dict]:
    layers = runner.model.layers
    shapes = {
        "qkv": [layer.self_attn.qkv_proj.weight for layer in layers],
        "o": [layer.self_attn.o_proj.weight for layer in layers],
        "gate_up": [layer.mlp.gate_up_proj.weight for layer in layers],
        "down": [layer.mlp.down_proj.weight for layer in layers],
        "lm_head": [runner.model.lm_head.weight] * 4,
    }
    rows = []
    for name, weights in shapes.items():
        n, k = weights[0].shape
        x = torch.randn(batch, k, device="cuda", dtype=weights[0].dtype)
        nbytes = 2 * n * k
        variants = {"cublas": lambda w, x=x: F.linear(x, w)}
        ref = F.linear(x, weights[0]).float()
        for label, fn in variants.items():
            try:
                out = fn(weights[0]).float()
                error = ((out - ref).norm() / ref.norm()).item()
                seconds = graph_time([lambda w=w, fn=fn: fn(w) for w in weights])
            except Exception as exc:  # a tile that does not fit (shared memory)
                rows.append({"op": name, "variant": label, "error": type(exc).__name__})
                continue
            rows.append({"op": name, "variant": label, "us": seconds * 1e6,
                         "tb_s": nbytes / seconds / 1e12, "of_copy": nbytes / seconds / copy_bw,
                         "rel_err": error})
    return rows


@torch.inference_mode()
def attention(engine, batch: int, copy_bw: float) -> list[dict]:
    from kvrecover.ops.triton.attention import (
        FAST_DECODE,
        INVARIANT_DECODE,
        paged_attention,
        tile_tokens,
    )
    from kvrecover.ops.triton.step_inputs import StepInputBuilder

    runner = engine.model_runner
    caches = runner.kv_caches
    config = runner.model.config
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    running = engine.scheduler.running
    step = decode_step(engine)
    builder = StepInputBuilder(runner.layout.block_size, tile_tokens(heads // kv_heads),
                               torch.device("cuda"), runner.max_model_len)
    layout = builder.pack(step)
    meta = builder.views(layout, builder.upload(layout)).attn
    kv_bytes = sum(r.num_tokens for r in running) * 2 * kv_heads * dim * caches[0].element_size()
    q = torch.randn(len(running), heads, dim, device="cuda", dtype=caches[0].dtype)
    variants = {"fast(current)": FAST_DECODE, "invariant(current)": INVARIANT_DECODE}
    for label, fields in ATTENTION:
        variants[label] = dataclasses.replace(FAST_DECODE, **fields)
    for label, fields in INVARIANT:
        variants[label] = dataclasses.replace(INVARIANT_DECODE, **fields)
    ref = paged_attention(q, caches[0], meta, dim**-0.5, decode=INVARIANT_DECODE).float()
    rows = []
    for label, decode in variants.items():
        try:
            out = paged_attention(q, caches[0], meta, dim**-0.5, decode=decode).float()
            error = ((out - ref).norm() / ref.norm()).item()
            seconds = graph_time([
                lambda c=c, d=decode: paged_attention(q, c, meta, dim**-0.5, decode=d)
                for c in caches
            ])
        except Exception as exc:
            rows.append({"op": "attention", "variant": label, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        rows.append({"op": "attention", "variant": label, "us": seconds * 1e6,
                     "tb_s": kv_bytes / seconds / 1e12, "of_copy": kv_bytes / seconds / copy_bw,
                     "rel_err": error})
    return rows


@torch.inference_mode()
def small_ops(runner, batch: int) -> list[dict]:
    """The small ops alone (16 calls per graph), with other warp counts for the row kernels."""
    import triton

    from kvrecover.ops.triton import fused_ops as t
    from kvrecover.ops.triton import sampling

    model = runner.model
    hidden = model.config.hidden_size
    inter = model.config.intermediate_size
    x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    gate_up = torch.randn(batch, 2 * inter, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, inter, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (batch,), device="cuda")
    w = model.layers[0].input_layernorm.weight
    emb = model.embed_tokens.weight
    logits = torch.randn(batch, model.config.vocab_size, device="cuda", dtype=torch.bfloat16)
    ops = {
        "embedding (F.embedding)": lambda: F.embedding(ids, emb),
        "embedding (triton)": lambda: t.embedding(ids, emb),
        "logits.float() + greedy": lambda: sampling.greedy_tokens(logits.float()),
        "upcast_greedy_tokens": lambda: sampling.upcast_greedy_tokens(logits),
    }
    for warps in (2, 4, 8, 16):
        ops[f"add_rms_norm warps={warps}"] = lambda wp=warps: t._rms_norm_kernel[(batch,)](
            x, residual, w, x, x.stride(0), residual.stride(0), x.stride(0), hidden, 1e-5,
            HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(hidden), PLUS_ONE=False,
            num_warps=wp)
    for block, warps in ((2048, 8), (1024, 4), (512, 2), (4096, 16), (1024, 8)):
        ops[f"silu_mul block={block} warps={warps}"] = lambda b=block, wp=warps: (
            t._silu_mul_kernel[(batch, triton.cdiv(inter, b))](
                gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=b, GELU_TANH=False,
                num_warps=wp))
    rows = []
    for name, fn in ops.items():
        try:
            rows.append({"op": name, "us": graph_time([fn] * 16) * 1e6})
        except Exception as exc:
            rows.append({"op": name, "us": float("nan"), "error": type(exc).__name__})
    return rows


def profile_batch(model_dir: Path, batch: int, prompt_len: int, steps: int, copy_bw: float,
                  batch_invariant: bool, wanted: list[str]) -> dict:
    from kvrecover import LLM

    tokens = batch * (prompt_len + 160)  # room for the batch's KV: no preemption
    kv_gb = max(12.0, 1.25 * tokens * ModelShape.of(model_dir).kv_bytes_per_token / 1e9)
    llm = LLM(str(model_dir), device="cuda:0", dtype="bfloat16", max_model_len=prompt_len + 144,
              enable_prefix_caching=False, kv_cache_memory_gb=kv_gb, max_num_seqs=max(batch, 16),
              batch_invariant=batch_invariant)
    engine = start_decoding(llm, batch, prompt_len)
    runner = engine.model_runner
    graph = runner.graphs.graphs[runner.graphs.bucket(batch)].graph
    replay_ms = _time_cuda(graph.replay, 30) * 1e3
    table = kernel_table(engine, steps)
    result = {"batch": batch, "batch_invariant": batch_invariant, "graph_replay_ms": replay_ms,
              "kernels": table}
    sections = {"eager_kernels": (eager_table, engine, batch, steps),
                "host": (host_profile, engine, steps)}
    if not batch_invariant:
        sections["linears"] = (linears, runner, batch, copy_bw)
        sections["attention"] = (attention, engine, batch, copy_bw)
        sections["small_ops"] = (small_ops, runner, batch)
    for key, (fn, *fn_args) in sections.items():
        if key not in wanted:
            continue
        try:  # one failing section must not lose the others' figures
            result[key] = fn(*fn_args)
        except Exception:
            traceback.print_exc()
            result[key] = []
    llm.close()
    del llm, engine, runner, graph, sections
    gc.collect()
    torch.cuda.empty_cache()
    return result


def print_result(r: dict) -> None:
    print(f"\n=== batch {r['batch']} batch_invariant={r['batch_invariant']}: graph replay "
          f"{r['graph_replay_ms']:.3f} ms/step; kernel sum "
          f"{sum(k['us'] for k in r['kernels']) / 1e3:.3f} ms/step")
    print(f"{'kernel':70} {'n/step':>7} {'us/step':>9} {'%':>6}")
    for k in r["kernels"][:24]:
        print(f"{k['name'][:70]:70} {k['count']:7.1f} {k['us']:9.1f} {k['pct']:6.1f}")
    eager = r.get("eager_kernels", [])
    print(f"--- eager forward, kernel sum {sum(k['us'] for k in eager) / 1e3:.3f} ms/step")
    for k in eager[:24]:
        print(f"{k['name'][:70]:70} {k['count']:7.1f} {k['us']:9.1f} {k['pct']:6.1f}")
    for section in ("linears", "attention"):
        for row in r.get(section, []):
            if "error" in row:
                print(f"  {row['op']:10} {row['variant']:34} {row['error']}")
            else:
                print(f"  {row['op']:10} {row['variant']:34} {row['us']:8.2f} us "
                      f"{row['tb_s']:5.2f} TB/s ({100 * row['of_copy']:5.1f}% copy) "
                      f"err {row['rel_err']:.1e}")
    for row in r.get("small_ops", []):
        print(f"  {row['op']:30} {row['us']:6.2f} us")
    if r.get("host"):
        print("--- host, us per engine step (own time under cProfile)")
    for row in r.get("host", []):
        print(f"  {row['name'][:80]:80} {row['us']:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--invariant", action="store_true", help="also the batch_invariant mode")
    parser.add_argument("--sections", nargs="+", default=["eager_kernels", "linears", "attention",
                                                         "small_ops", "host"])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/kvrecover-bench-llama1b"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ceilings = device_ceilings()
    copy_bw = ceilings["copy_bytes_per_s"]
    print(f"device: {torch.cuda.get_device_name()}  copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    model_dir = build_checkpoint(args.model_dir)
    results = {"ceilings": ceilings, "runs": []}
    for batch in args.batches:
        for invariant in (False, True) if args.invariant else (False,):
            r = profile_batch(model_dir, batch, args.prompt_len, args.steps, copy_bw, invariant,
                              args.sections)
            results["runs"].append(r)
            print_result(r)
            sys.stdout.flush()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_decode.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
