"""GPU benchmark: kvrecover vs Hugging Face `generate` on a Llama-shaped model.

Runs the checkpoint in `--model-dir`, or writes random bf16 weights of `--shape`
(1b: Llama-3.2-1B, the default; 8b: Llama-3.1-8B; no download), measures the
device's copy bandwidth and bf16 matmul rate, then times prefill and decode for
kvrecover (default, batch-invariant, eager) and HF on the same prompts, and prints
a table with the ratios to HF and to the roofline of the shape it ran (read from
the checkpoint's config.json).

    PYTHONPATH=. python bench/bench_gpu.py [--shape 1b|8b] [--batches 1 16 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time
from pathlib import Path

import torch
from model_shapes import SHAPES, ModelShape, resolve_model_dir


def device_ceilings() -> dict[str, float]:
    """Measured device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate."""
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_s = _time_cuda(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = _time_cuda(lambda: a @ b, 20)
    return {"copy_bytes_per_s": 2 * (1 << 30) / copy_s, "matmul_flop_per_s": 2 * 8192**3 / mm_s}


def _time_cuda(fn, reps: int, inner: int = 1) -> float:
    """Median seconds per call; `inner` calls per timing keep the GPU queue ahead of the host."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return sorted(times)[len(times) // 2]


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 128000, (count, length), generator=generator).tolist()


def time_kvrecover(model_dir: Path, batch: int, prompt_len: int, new_tokens: int, **llm_args) -> dict:
    """Prefill and decode throughput of kvrecover for one batch shape (after a warm-up run)."""
    from kvrecover import LLM, SamplingParams

    shape = ModelShape.of(model_dir)
    # Room for the whole batch's KV (bf16) with a margin, at least 12 GB: a cache that
    # cannot hold the batch preempts, and the figures would time recomputation.
    kv_bytes = shape.kv_bytes_per_token * batch * (prompt_len + new_tokens + 16)
    llm = LLM(str(model_dir), device="cuda:0", dtype="bfloat16", max_model_len=prompt_len + new_tokens + 16,
              enable_prefix_caching=False, kv_cache_memory_gb=max(12.0, 1.25 * kv_bytes / 1e9),
              max_num_seqs=max(batch, 16), **llm_args)

    def run(prompts, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        torch.cuda.synchronize()
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return time.perf_counter() - start

    run(random_prompts(batch, prompt_len, 1), new_tokens)  # warm-up: compiles, captures graphs
    prefill_s = min(run(random_prompts(batch, prompt_len, 2 + i), 1) for i in range(3))
    replays = _time_graph_replays(llm.engine.model_runner.graphs)
    clock = _StepClock(llm.engine, batch)
    total_s = run(random_prompts(batch, prompt_len, 9), new_tokens)
    result = _rates(batch, prompt_len, new_tokens, prefill_s, total_s)
    # The same run's decode phase on the host clock: from the step that gave every request
    # its first token to the last step. `total_s - prefill_s` subtracts another run's
    # prefill, whose spread (+-30 ms at batch 64) is 0.24 ms a decode step.
    decode_s = clock.ends[-1] - clock.first_token_of_all
    result["decode_tok_s_in_run"] = batch * (new_tokens - 1) / decode_s
    result["decode_tok_s_decode_only"] = clock.decode_only_tokens / max(clock.decode_only_s, 1e-9)
    result["decode_only_steps"] = clock.decode_only_steps
    full = [start.elapsed_time(end) for size, start, end in replays if size == batch]
    if full:
        result["decode_gpu_ms_per_step"] = sorted(full)[len(full) // 2]
        wall_ms = 1e3 * (total_s - prefill_s) / (new_tokens - 1)
        result["decode_host_ms_per_step"] = wall_ms - result["decode_gpu_ms_per_step"]
        in_run_ms = 1e3 * decode_s / (new_tokens - 1)
        result["decode_in_run_host_ms_per_step"] = in_run_ms - result["decode_gpu_ms_per_step"]
    return result


class _StepClock:
    """The host clock at the end of every engine step from now on, the end of the first
    step by which `requests` requests have reported a token, and a decode-only clock.

    The decode-only clock adds up the intervals of the steps that computed no prompt
    token and produced tokens (the engine's own counters, read after each step), and
    the tokens those steps produced: under chunked prefill a long prompt's chunks share
    steps with the other requests' decode, and "first token of all to the last step"
    would count tokens produced before that window and time steps that prefilled."""

    def __init__(self, engine, requests: int) -> None:
        self.ends: list[float] = []
        self.first_token_of_all = float("nan")
        self.decode_only_s = 0.0
        self.decode_only_tokens = 0
        self.decode_only_steps = 0
        started: set[str] = set()
        step, stats = engine.step, engine.stats

        def timed():
            prompt, generated = stats.prompt_tokens_computed, stats.generation_tokens
            outputs = step()
            now = time.perf_counter()
            produced = stats.generation_tokens - generated
            if self.ends and stats.prompt_tokens_computed == prompt and produced:
                self.decode_only_s += now - self.ends[-1]
                self.decode_only_tokens += produced
                self.decode_only_steps += 1
            self.ends.append(now)
            if len(started) < requests:
                started.update(o.request_id for o in outputs if o.outputs[0].token_ids)
                if len(started) >= requests:
                    self.first_token_of_all = now
            return outputs

        engine.step = timed


def _time_graph_replays(graphs) -> list:
    """Record device events around every decode-graph step (upload + replay) from now on."""
    replays: list = []
    if graphs is None:
        return replays
    run = graphs.run

    def timed(scheduled, *args):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = run(scheduled, *args)
        end.record()
        replays.append((len(scheduled), start, end))
        return logits

    graphs.run = timed
    return replays


def time_hf(model_dir: Path, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """The same for Hugging Face `generate` (greedy, its default dynamic cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()

    def run(seed, max_tokens):
        ids = torch.tensor(random_prompts(batch, prompt_len, seed), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
            )
        torch.cuda.synchronize()
        assert out.shape[1] == prompt_len + max_tokens
        return time.perf_counter() - start

    run(1, 4)
    prefill_s = min(run(2 + i, 1) for i in range(2))
    total_s = run(9, new_tokens)
    return _rates(batch, prompt_len, new_tokens, prefill_s, total_s)


def profile_steps(model_dir: Path, batch: int, prompt_len: int, batch_invariant: bool) -> None:
    """Print the top GPU kernels of one eager prefill step and of eager decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from kvrecover import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cuda:0", dtype="bfloat16", max_model_len=prompt_len + 64,
              enable_prefix_caching=False, kv_cache_memory_gb=8, enforce_eager=True,
              max_num_batched_tokens=batch * prompt_len, batch_invariant=batch_invariant)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for warm in range(2):
        for i, prompt in enumerate(random_prompts(batch, prompt_len, 20 + warm)):
            engine.add_request(f"{warm}-{i}", {"prompt_token_ids": prompt}, params)
        if warm == 0:
            while engine.has_unfinished():
                engine.step()
    torch.cuda.synchronize()
    for label, steps in (("prefill step", 1), ("decode steps x5", 5)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        print(f"--- {label}, batch {batch}, batch_invariant={batch_invariant}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    if not batch_invariant:
        _attention_microbench(engine)


@torch.inference_mode()
def _attention_microbench(engine) -> None:
    """Attention alone over the running requests' caches (decode, and prefill of the prompts)."""
    from kvrecover.ops.triton.attention import (
        FAST_DECODE,
        INVARIANT_DECODE,
        paged_attention,
        tile_tokens,
    )
    from kvrecover.ops.triton.step_inputs import StepInputBuilder
    from kvrecover.step_messages import ScheduledRequest

    runner = engine.model_runner
    running = engine.scheduler.running
    cache = runner.kv_caches[0]
    heads = runner.model.config.num_attention_heads
    prompt_len = running[0].num_prompt_tokens
    steps = {
        "decode": [ScheduledRequest(r.request_id, [0], r.num_tokens - 1, list(r.block_ids),
                                    True, None, 0) for r in running],
        "prefill": [ScheduledRequest(r.request_id, [0] * prompt_len, 0, list(r.block_ids),
                                     True, None, 0) for r in running],
    }
    group = heads // cache.shape[3]
    kv_bytes = sum(r.num_tokens for r in running) * 2 * cache.shape[3] * cache.shape[4] * 2
    flops = len(running) * 4 * heads * cache.shape[-1] * prompt_len**2 / 2
    variants = [("decode", c.block_m, c.num_warps, c.num_stages, c)
                for c in (INVARIANT_DECODE, FAST_DECODE)]
    variants += [("prefill", bm, w, s, INVARIANT_DECODE)
                 for bm, w in ((64, 4), (128, 8)) for s in (1, 2, 3)]
    for label, block_m, warps, stages, decode in variants:
        builder = StepInputBuilder(runner.layout.block_size, tile_tokens(group, block_m),
                                   torch.device("cuda"), runner.max_model_len)
        layout = builder.pack(steps[label])
        meta = builder.views(layout, builder.upload(layout)).attn
        num_tokens = sum(len(s.token_ids) for s in steps[label])
        query = torch.randn(num_tokens, heads, cache.shape[-1], device="cuda", dtype=cache.dtype)
        seconds = _time_cuda(
            lambda q=query, m=meta, s=stages, b=block_m, w=warps, d=decode: paged_attention(
                q, cache, m, cache.shape[-1] ** -0.5, num_stages=s, prefill_block_m=b, prefill_warps=w, decode=d
            ),
            10, inner=10,
        )
        rate = (f"{kv_bytes / seconds / 1e12:.2f} TB/s of KV" if label == "decode"
                else f"{flops / seconds / 1e12:.0f} TFLOP/s")
        print(f"{label} attention, {len(running)} requests, block_m={block_m} warps={warps} "
              f"stages={stages}: {seconds * 1e6:.1f} us/layer, {rate}")


@torch.inference_mode()
def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(out, in) of each of `shape`'s linears, the LM head included."""
    q_size = shape.num_attention_heads * shape.head_dim
    kv_size = shape.num_key_value_heads * shape.head_dim
    hidden, inter = shape.hidden_size, shape.intermediate_size
    return {"qkv": (q_size + 2 * kv_size, hidden), "o": (hidden, q_size),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "lm_head": (shape.vocab_size, hidden)}


def matmul_configs(shape: ModelShape) -> None:
    """Time batch-invariant matmul tile configs on prefill shapes; check each against decode rows."""
    from kvrecover.ops.triton.batch_invariant_matmul import linear

    configs = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (128, 256, 8, 3),
               (128, 256, 8, 4), (256, 128, 8, 3), (64, 256, 4, 4), (128, 64, 4, 4)]
    linears = linear_shapes(shape)
    for n, k in (linears[name] for name in ("qkv", "o", "gate_up", "down")):
        x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        decode_rows = linear(x[:16], w)
        cublas = _time_cuda(lambda x=x, w=w: x @ w.T, 10)
        line = f"matmul {8192}x{n}x{k}: cuBLAS {2 * 8192 * n * k / cublas / 1e12:.0f} TFLOP/s"
        for config in configs:
            try:
                seconds = _time_cuda(lambda x=x, w=w, c=config: linear(x, w, config=c), 10)
                same = torch.equal(linear(x, w, config=config)[:16], decode_rows)
                line += f" | {config}: {2 * 8192 * n * k / seconds / 1e12:.0f}{'' if same else ' NOT-INVARIANT'}"
            except Exception as error:  # a config that does not compile (shared memory)
                line += f" | {config}: failed ({type(error).__name__})"
        print(line, flush=True)


def _graph_time(fn, calls: int = 20, reps: int = 10) -> float:
    """Seconds per call of `fn`, replayed in a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _time_cuda(graph.replay, reps) / calls


def _time_cycling(weights: list[torch.Tensor], call) -> float:
    """Seconds per `call(weight)`, graph-timed, each call on the next of `weights`."""
    turn = iter(range(1 << 62))
    return _graph_time(lambda: call(weights[next(turn) % len(weights)]), calls=2 * len(weights))


@torch.inference_mode()
def decode_linears(shape: ModelShape, batch: int = 16) -> None:
    """cuBLAS against the split-K Triton matmul on the decode linears (graph-timed, weights
    cycled through more than the L2 cache so every call streams its weight)."""
    from kvrecover.ops.triton.batch_invariant_matmul import linear

    shapes = linear_shapes(shape)
    configs = [(16, 64, 4, 4), (16, 128, 4, 4), (64, 128, 4, 4)]
    for name, (n, k) in shapes.items():
        copies = max(1, -(-400_000_000 // (2 * n * k)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
        timed = functools.partial(_time_cycling, weights)
        nbytes = 2 * n * k
        cublas = timed(lambda w, x=x: x @ w.T)
        line = f"decode linear {name} {batch}x{n}x{k}: cuBLAS {cublas * 1e6:.1f} us ({nbytes / cublas / 1e12:.2f} TB/s)"
        for config in configs:
            for chunks in (1, 2, 4, 8, 16):
                if k % (chunks * 64) or (name == "lm_head" and chunks > 1):
                    continue
                seconds = timed(lambda w, x=x, c=config, s=chunks: linear(x, w, config=c, chunks=s))
                line += f" | {config[:3]}x{chunks}: {seconds * 1e6:.1f}"
        print(line, flush=True)
        del weights
        _free_memory()


def _free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _rates(batch, prompt_len, new_tokens, prefill_s, total_s) -> dict:
    return {
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "decode_tok_s": batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9),
        "prefill_s": prefill_s,
        "total_s": total_s,
    }


def rooflines(ceilings: dict, shape: ModelShape, batch: int, prompt_len: int,
              new_tokens: int) -> dict:
    """Decode: bytes per step (bf16 weights once, the LM head included, + the batch's KV) at
    copy bandwidth; prefill: FLOPs at the matmul rate; both for `shape`."""
    layers, hidden = shape.num_hidden_layers, shape.hidden_size
    q_size = shape.num_attention_heads * shape.head_dim
    layer_params = shape.layer_params
    weight_bytes = 2 * (layers * layer_params + shape.vocab_size * hidden)
    kv_bytes_per_token = shape.kv_bytes_per_token
    mean_context = prompt_len + new_tokens / 2
    step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token
    flops_per_token = 2 * layers * layer_params + 4 * layers * q_size * prompt_len / 2
    return {
        "decode_tok_s": batch * ceilings["copy_bytes_per_s"] / step_bytes,
        "prefill_tok_s": ceilings["matmul_flop_per_s"] / flops_per_token,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-new-tokens", type=int, default=32,
                        help="HF decodes fewer tokens (it is slow); its rate is per step anyway")
    parser.add_argument("--modes", nargs="+", default=["default", "batch_invariant", "eager"])
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="print kernel profiles and attention variants at batch 16")
    parser.add_argument("--matmul-configs", action="store_true",
                        help="only time the Triton matmul's configs (prefill and decode shapes)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="write random bf16 weights of this shape (default 1b) where "
                             "--model-dir holds no checkpoint")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the checkpoint to run (default /tmp/kvrecover-bench-llama<shape>); "
                             "its config.json gives the roofline's shape")
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args()

    ceilings = device_ceilings()
    print(f"device: {torch.cuda.get_device_name()}  copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s"
          f"  bf16 matmul {ceilings['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    if args.matmul_configs:  # random matrices only: no checkpoint needed
        shape = (ModelShape.of(args.model_dir) if args.model_dir is not None and args.shape is None
                 else ModelShape.from_config(SHAPES[args.shape or "1b"]))
        matmul_configs(shape)
        decode_linears(shape)
        return
    model_dir = resolve_model_dir(args.model_dir, args.shape)
    shape = ModelShape.of(model_dir)
    print(f"model: {model_dir} ({shape.label})", flush=True)
    if args.profile:
        for batch_invariant in (False, True):
            profile_steps(model_dir, 16, args.prompt_len, batch_invariant)
            _free_memory()
    mode_args = {"default": {}, "batch_invariant": {"batch_invariant": True},
                 "eager": {"enforce_eager": True}}
    results: dict = {"ceilings": ceilings, "shape": {"label": shape.label, **vars(shape)},
                     "model_dir": str(model_dir), "runs": []}
    for batch in args.batches:
        roof = rooflines(ceilings, shape, batch, args.prompt_len, args.new_tokens)
        hf = None
        if not args.no_hf:
            hf = time_hf(model_dir, batch, args.prompt_len, args.hf_new_tokens)
            _free_memory()
            results["runs"].append({"engine": "hf", "batch": batch, **hf})
        for mode in args.modes:
            run = time_kvrecover(model_dir, batch, args.prompt_len, args.new_tokens, **mode_args[mode])
            _free_memory()
            results["runs"].append({"engine": f"kvrecover-{mode}", "batch": batch, **run})
            print(f"  batch {batch:3d} {mode:16s} prefill {run['prefill_tok_s']:10,.0f} tok/s  "
                  f"decode {run['decode_tok_s']:9,.0f} tok/s  decode step: GPU "
                  f"{run.get('decode_gpu_ms_per_step', float('nan')):.3f} ms + host "
                  f"{run.get('decode_host_ms_per_step', float('nan')):.3f} ms; same run's decode "
                  f"steps: {run['decode_tok_s_in_run']:9,.0f} tok/s, host "
                  f"{run.get('decode_in_run_host_ms_per_step', float('nan')):.3f} ms; decode-only "
                  f"steps ({run['decode_only_steps']}): {run['decode_tok_s_decode_only']:9,.0f} "
                  "tok/s", flush=True)
        results["runs"].append({"engine": "roofline", "batch": batch, **roof})

    print(f"\n{shape.label}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens "
          f"(HF: {args.hf_new_tokens}); bf16; tok/s, x HF, % of roofline")
    print("(decode: batch x (new - 1) / (this run's time - a prefill run's time); in-run: the "
          "same run's decode phase on the host clock; dec-only: the same run's steps that "
          "computed no prompt token)")
    header = f"{'batch':>5} {'engine':24} {'prefill':>10} {'xHF':>6} {'%roof':>6} " \
             f"{'decode':>9} {'xHF':>6} {'%roof':>6} {'in-run':>9} {'%roof':>6} " \
             f"{'dec-only':>9} {'%roof':>6}"
    print(header)
    for batch in args.batches:
        rows = [r for r in results["runs"] if r["batch"] == batch]
        hf = next((r for r in rows if r["engine"] == "hf"), None)
        roof = next(r for r in rows if r["engine"] == "roofline")
        for r in rows:
            x_pre = r["prefill_tok_s"] / hf["prefill_tok_s"] if hf else float("nan")
            x_dec = r["decode_tok_s"] / hf["decode_tok_s"] if hf else float("nan")
            in_run = r.get("decode_tok_s_in_run", float("nan"))
            only = r.get("decode_tok_s_decode_only", float("nan"))
            print(f"{batch:5d} {r['engine']:24} {r['prefill_tok_s']:10,.0f} {x_pre:6.1f} "
                  f"{100 * r['prefill_tok_s'] / roof['prefill_tok_s']:6.1f} "
                  f"{r['decode_tok_s']:9,.0f} {x_dec:6.1f} "
                  f"{100 * r['decode_tok_s'] / roof['decode_tok_s']:6.1f} "
                  f"{in_run:9,.0f} {100 * in_run / roof['decode_tok_s']:6.1f} "
                  f"{only:9,.0f} {100 * only / roof['decode_tok_s']:6.1f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
