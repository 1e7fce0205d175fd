"""Recovery-latency benchmark: what a KV load failure costs a user in time.

    PYTHONPATH=. python bench/bench_recovery.py [--device cpu] [--batch 4] [--prompt-tokens 512]
        [--max-tokens 8] [--rates 0 0.01 0.1 0.5 1] [--repeats 2] [--plot bench/recovery_cpu.png]
    PYTHONPATH=. python bench/bench_recovery.py --device cuda --batch 16 --prompt-tokens 1024 \
        [--shape 1b|8b | --model-dir DIR] --plot $OUT/recovery_gpu.png

A producer prefills a batch of prompts into a `SharedStorageConnector` folder. A
consumer (policy `recompute`, prefix caching off) then runs the same batch through
a `FaultInjectionConnector` whose plan makes a given share of all the batch's
stored blocks fail ("missing"), sync and async. Failed blocks are drawn at random
(seeded) over the whole batch; a request loses every token from its first failed
block on, so the lost tokens are counted per request.

Per row: time to first token of the batch (until every request has its first
token; the mean over requests beside it), end-to-end latency of the batch, and the
predicted cost: the time to recompute exactly the lost tokens, measured separately
on an engine without a connector whose prefix cache holds each request's KV up to
its cut (the prefill of the tails minus that of the no-failure tails). The goal:
measured extra TTFT <= 1.2 x predicted + one decode step (a sync load finds its
failures only after the step that consumed it).

"recomputed" is the engine's `kv_load_recomputed_tokens`: the tokens a failed load
lost that the engine computed again; sync, also the token each failed request
sampled before its failure was known. An async request that failed asks the
connector once more (`kv_load_retry_limit`, 1 by default; `--retry-limit`): what
that load brings back is not recomputed, and the injected faults stay on the same
blocks, so the retry fails at the same block and async recomputes what sync does.

CPU: the built-in default model (float32), or the checkpoint in `--model-dir`.
CUDA: the checkpoint in `--model-dir`, else random bf16 weights of `--shape`
(1b: Llama-3.2-1B, the default; 8b: Llama-3.1-8B; `model_shapes.py`, no download).
The title names the shape read from the checkpoint's config.json.
Times are the best of --repeats; each repeat uses fresh prompts of the same shape.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrecover import LLM, KVTransferConfig, SamplingParams

MIN_TOKEN, MAX_TOKEN = 10, 32000  # inside both models' vocabularies


@dataclass
class FailurePlan:
    """Which loaded block positions fail, per request of the batch, for one failure rate."""

    rate: float
    positions: list[list[int]]  # per request, sorted block positions within its loaded blocks

    def cuts(self, loaded_blocks: int, block_size: int) -> list[int]:
        """Tokens of each request still valid after recovery (start of its first failed block)."""
        return [(p[0] if p else loaded_blocks) * block_size for p in self.positions]

    def lost_tokens(self, loaded_blocks: int, block_size: int) -> int:
        return sum(loaded_blocks * block_size - cut for cut in self.cuts(loaded_blocks, block_size))


def make_plan(rate: float, batch: int, loaded_blocks: int, seed: int) -> FailurePlan:
    """Fail round(rate x all loaded blocks) blocks (at least one when rate > 0), seeded."""
    total = batch * loaded_blocks
    count = 0 if rate <= 0 else min(total, max(1, round(rate * total)))
    chosen = random.Random(seed).sample(range(total), count)
    positions: list[list[int]] = [[] for _ in range(batch)]
    for flat in sorted(chosen):
        positions[flat // loaded_blocks].append(flat % loaded_blocks)
    return FailurePlan(rate, positions)


def fault_rules(plan: FailurePlan, first_load_index: int) -> list[dict]:
    """FaultInjectionConnector rules for one run whose requests load in batch order."""
    return [{"requests": first_load_index + i, "blocks": positions, "kind": "missing"}
            for i, positions in enumerate(plan.positions) if positions]


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(MIN_TOKEN, MAX_TOKEN, (count, length), generator=generator).tolist()


def timed_batch(llm: LLM, prompts: list[list[int]], max_tokens: int,
                outputs: list[list[int]] | None = None) -> tuple[float, float, float]:
    """(batch TTFT, mean TTFT, end-to-end) seconds of one batch driven step by step; the
    generated ids, in prompt order, go to `outputs` when given."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tag = time.perf_counter_ns()
    first: dict[str, float] = {}
    finished: dict[str, list[int]] = {}
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{tag}-{i}", {"prompt_token_ids": prompt}, params)
    steps = 0
    while llm.engine.has_unfinished():
        steps += 1
        if steps > 100_000:
            raise RuntimeError("the engine did not finish the batch")
        for output in llm.engine.step():
            if output.outputs[0].token_ids and output.request_id not in first:
                first[output.request_id] = time.perf_counter() - started
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    total = time.perf_counter() - started
    if outputs is not None:
        outputs.extend(finished.get(f"r{tag}-{i}", []) for i in range(len(prompts)))
    if len(first) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(first)} request(s) produced no token")
    return max(first.values()), sum(first.values()) / len(first), total


def release_memory() -> None:
    """Free what engines the caller dropped held (their GPU memory, if any)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def consumer(llm_args: dict, store: Path, mode: str, plans: list[FailurePlan], repeats: int,
             batch: int, retry_limit: int | None) -> LLM:
    """A consumer whose r-th round of plan p (run r * len(plans) + p) fails as plan p says."""
    rules = []
    for run_index in range(repeats * len(plans)):
        rules += fault_rules(plans[run_index % len(plans)], run_index * batch)
    retry = {} if retry_limit is None else {"kv_load_retry_limit": retry_limit}
    transfer = KVTransferConfig("FaultInjectionConnector", "kv_consumer", {
        "inner_connector": "SharedStorageConnector", "shared_storage_path": str(store),
        "async_load": mode == "async", "faults": rules,
    }, **retry)
    llm = LLM(**llm_args, enable_prefix_caching=False, kv_transfer_config=transfer)
    timed_batch(llm, random_prompts(batch, 48, seed=999), 2)  # warm-up; nothing stored, no load
    return llm


def timed_consumer(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple:
    """(batch TTFT, mean TTFT, e2e, recomputed tokens) of one batch."""
    before = llm.stats["kv_load_recomputed_tokens"]
    ttft, mean_ttft, e2e = timed_batch(llm, prompts, max_tokens)
    return ttft, mean_ttft, e2e, llm.stats["kv_load_recomputed_tokens"] - before


def timed_recompute(llm: LLM, cuts: list[int], batch: int, prompt_tokens: int, seed: int) -> float:
    """Time to first token of fresh prompts whose KV before each cut is in the prefix cache."""
    prompts = random_prompts(batch, prompt_tokens, seed)
    prefixes = [p[:cut] for p, cut in zip(prompts, cuts) if cut]
    if prefixes:  # fills the prefix cache with exactly the KV that survives the failure
        timed_batch(llm, prefixes, 1)
    return timed_batch(llm, prompts, 1)[0]


def measure(llm_args: dict, store: Path, plans: list[FailurePlan], prompts: list[list[list[int]]],
            args: argparse.Namespace, loaded_blocks: int, block_size: int):
    """Best-of-rounds consumer rows per mode and predicted costs per plan. Every round runs
    every plan in every mode and the recompute, so a busy spell hits them all alike."""
    engines = {mode: consumer(llm_args, store, mode, plans, len(prompts), args.batch,
                              args.retry_limit) for mode in ("sync", "async")}
    recompute = LLM(**llm_args, enable_prefix_caching=True)
    timed_batch(recompute, random_prompts(args.batch, 48, seed=998), 1)  # warm-up
    best = {mode: [(float("inf"),) * 4 for _ in plans] for mode in engines}
    best_recompute = [float("inf")] * len(plans)
    for round_index, batch_prompts in enumerate(prompts):
        for index, plan in enumerate(plans):
            for mode, llm in engines.items():
                run = timed_consumer(llm, batch_prompts, args.max_tokens)
                best[mode][index] = (*(min(a, b) for a, b in zip(best[mode][index][:3], run[:3])),
                                     run[3])
            seed = args.seed + 10_000 + 1000 * index + round_index
            best_recompute[index] = min(best_recompute[index], timed_recompute(
                recompute, plan.cuts(loaded_blocks, block_size), args.batch, args.prompt_tokens,
                seed))
    engines.clear()
    del recompute
    release_memory()
    return best, best_recompute


def plot(rows: dict[str, list[tuple]], predicted: list[float], rates: list[float], path: Path,
         title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path})")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    positions = list(range(len(rates)))
    for mode, results in rows.items():
        axes.plot(positions, [r[0] for r in results], marker="o", label=f"measured, {mode}")
    base = rows["sync"][0][0]
    axes.plot(positions, [base + p for p in predicted], linestyle="--", color="gray",
              label="TTFT(0%) + recompute of the lost tokens")
    axes.set_xticks(positions, [f"{rate:.0%}" for rate in rates])
    axes.set_xlabel("stored blocks that fail")
    axes.set_ylabel("time to first token of the batch (s)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rates", type=float, nargs="+", default=[0, 0.01, 0.1, 0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=2, help="best of N (2)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--shape", choices=["1b", "8b"], default=None,
                        help="CUDA: write random bf16 weights of this shape (default 1b) where "
                             "--model-dir holds no checkpoint")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the checkpoint to run (CUDA default: "
                             "/tmp/kvrecover-bench-llama<shape>; CPU default: the built-in model)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of TTFT vs failure rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retry-limit", type=int, default=None,
                        help="kv_load_retry_limit of the consumer (default: the engine's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("kvrecover").setLevel(logging.ERROR)  # one warning per failed block
    if args.rates[0] != 0:
        raise ValueError(f"--rates must start with 0 (the reference row), got {args.rates}")
    block_size = 16
    # bench/ is on sys.path when run as a script
    from model_shapes import ModelShape, resolve_model_dir

    if args.device == "cuda":
        model_dir = resolve_model_dir(args.model_dir, args.shape)
        llm_args = dict(model=str(model_dir), device="cuda:0", dtype="bfloat16",
                        kv_cache_memory_gb=8,
                        max_model_len=args.prompt_tokens + args.max_tokens + 16,
                        max_num_seqs=max(16, args.batch))
        title = (f"{ModelShape.of(model_dir).label} bf16, {torch.cuda.get_device_name()}, "
                 f"{args.batch} x {args.prompt_tokens} tokens")
    else:
        if args.shape is not None:
            raise ValueError("--shape writes its checkpoint on the GPU; on the CPU give a "
                             "checkpoint folder as --model-dir")
        model = None if args.model_dir is None else str(args.model_dir)
        llm_args = dict(model=model, device="cpu", dtype="float32")
        label = "default model"
        if args.model_dir is not None:
            shape = ModelShape.of(args.model_dir)
            label = shape.label
            global MAX_TOKEN  # a small checkpoint's vocabulary bounds every prompt
            MAX_TOKEN = min(MAX_TOKEN, shape.vocab_size)
        title = f"{label} f32, CPU, {args.batch} x {args.prompt_tokens} tokens"
    loaded_blocks = (args.prompt_tokens - 1) // block_size  # the last token is never loaded
    plans = [make_plan(rate, args.batch, loaded_blocks, args.seed + i)
             for i, rate in enumerate(args.rates)]
    prompts = [random_prompts(args.batch, args.prompt_tokens, args.seed + 1 + r)
               for r in range(args.repeats)]
    store = Path(tempfile.mkdtemp(prefix="kvrecover_recovery_"))
    try:
        producer = LLM(**llm_args, enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(
            "SharedStorageConnector", "kv_producer", {"shared_storage_path": str(store)}))
        for batch_prompts in prompts:
            producer.generate([{"prompt_token_ids": p} for p in batch_prompts],
                              SamplingParams(temperature=0, max_tokens=1))
        del producer
        release_memory()
        rows, recompute = measure(llm_args, store, plans, prompts, args, loaded_blocks,
                                  block_size)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    predicted = [t - recompute[0] for t in recompute]
    print(f"\n{title}; {args.max_tokens} new tokens, best of {args.repeats}\n")
    print("| mode | failed blocks | lost tokens | recomputed | TTFT s (mean) | e2e s "
          "| extra TTFT s | predicted s | 1.2 x pred + step | within |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for mode, results in rows.items():
        ttft0, _, e2e0 = results[0][:3]
        step = (e2e0 - ttft0) / max(1, args.max_tokens - 1)
        for (ttft, mean_ttft, e2e, recomputed), plan, pred in zip(results, plans, predicted):
            failed = sum(len(p) for p in plan.positions)
            lost = plan.lost_tokens(loaded_blocks, block_size)
            bound = 1.2 * pred + step
            extra = ttft - ttft0
            print(f"| {mode} | {failed} ({plan.rate:.0%}) | {lost} | {recomputed} "
                  f"| {ttft:.3f} ({mean_ttft:.3f}) | {e2e:.3f} | {extra:+.3f} | {pred:.3f} "
                  f"| {bound:.3f} | {'yes' if extra <= bound else 'NO'} |")
    if args.plot:
        plot(rows, predicted, args.rates, args.plot, title)


if __name__ == "__main__":
    main()
