"""Sliding-window benchmark: what KV cache groups save a Gemma 3-shaped model (issue 21).

    PYTHONPATH=. python bench/bench_windowed.py [--device cpu] [--lengths 512 2048] [--out x.json]
    PYTHONPATH=. python bench/bench_windowed.py --device cuda --shape gemma3-1b \
        --lengths 2048 8192 32768 --out $OUT/windowed.json

Two checkpoints with the same random weights: the Gemma 3 shape (`bench/gemma3_shape`,
5 sliding-window layers to 1 global; `--shape tiny` shrinks it for the CPU) and the same
config with every layer "full_attention".

1. Blocks held and bytes loaded per request, per prompt length: a producer
   (`SharedStorageConnector`, kv_producer) prefills one prompt; the peak of the block
   pool's blocks in use during that prefill is the request's (one request at a time,
   prefix caching off), times the engine's bytes per block id (`block_nbytes`). A
   consumer then loads the prompt from the folder; "loaded" is the engine's
   `kv_load_bytes` counter (the blocks the connector was asked to load, every group's).
2. Time to first token with 0 / 10 / 100 % of every group's loaded blocks failed
   ("missing", `FaultInjectionConnector` around the shared storage; plus 10 % of the
   windowed groups' blocks only), block-precise recovery against recompute-from-0, the
   latter by a bench-only `KVLoadRecovery` subclass (vLLM's rule for multi-group models,
   vllm#50388). Outputs must equal the producer's (no load) token for token.
3. `--device cuda` only: decode tok/s and % of the roofline, bytes per step = weights
   + the KV actually read (full layers the whole context, windowed ones at most W).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from bench_gpu import _rates, _time_graph_replays, device_ceilings
from bench_recovery import random_prompts, release_memory, timed_batch
from gemma3_checkpoint import write_checkpoints

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.engine.recovery import KVLoadRecovery
from kvrecover.kv_groups import KVCacheGroup

BLOCK_SIZE = 16
# Failure scenarios of part 2: the share of the prompt's loaded block positions that fail
# (seeded), in every group that loaded them; "last block" is the last loaded one only.
SCENARIOS = {"0%": 0.0, "10%": 0.1, "100%": 1.0, "last block": None}


class RecomputeFromZero(KVLoadRecovery):
    """BENCH ONLY, not an engine option: vLLM's rule for a multi-group model (#50388),
    every request with an invalid block recomputes from token 0."""

    def rollback_point(self, request, invalid) -> int:
        return 0


@dataclass
class BlocksRow:
    """Part 1, one model at one prompt length."""

    model: str
    prompt_tokens: int
    peak_blocks: int  # during the (chunked) prefill
    decode_blocks_per_group: list[int]  # held at the first decode step
    peak_bytes: int
    decode_bytes: int
    loaded_bytes: int
    stored_bytes: int


@dataclass
class RecoveryRow:
    """Part 2, one recovery rule under one failure scenario (best TTFT of the repeats)."""

    recovery: str
    scenario: str
    first_failed_token: int | None  # start of the first failed block (None: no failure)
    ttft_s: float
    recomputed_tokens: int


def storage(role: str, store: Path, **extra) -> KVTransferConfig:
    return KVTransferConfig("SharedStorageConnector", role, {"shared_storage_path": str(store),
                                                             **extra})


def blocks_in_use(llm: LLM) -> int:
    pool = llm.engine.scheduler.kv_manager.pool
    return pool.num_usable_blocks - pool.num_free_blocks


def prefill_blocks(llm: LLM, prompt: list[int]) -> tuple[int, list[int]]:
    """(peak blocks in use during the prefill, blocks per group at the first decode step)
    of one request run alone."""
    baseline = blocks_in_use(llm)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.engine.add_request(f"blocks-{time.perf_counter_ns()}", {"prompt_token_ids": prompt},
                           params)
    peak, per_group = 0, None
    while llm.engine.has_unfinished():
        outputs = llm.engine.step()
        generated = len(outputs[0].outputs[0].token_ids) if outputs else 0
        if generated <= 1:
            peak = max(peak, blocks_in_use(llm) - baseline)
        if per_group is None and generated == 2:
            running = llm.engine.scheduler.running
            per_group = llm.engine.scheduler.kv_manager.blocks_held(running[0]) if running else []
    return peak, per_group or []


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def blocks_and_bytes(name: str, model_dir: Path, llm_args: dict, lengths: list[int],
                     seed: int) -> list[BlocksRow]:
    """Part 1 for one model: prefill each length in a producer, load it in a consumer."""
    store = Path(tempfile.mkdtemp(prefix="kvrecover_windowed_"))
    prompts = [random_prompts(1, n, seed + n)[0] for n in lengths]
    rows = []
    try:
        producer = LLM(str(model_dir), **llm_args, kv_transfer_config=storage("kv_producer", store))
        block_nbytes = producer.engine.scheduler.kv_manager.block_nbytes
        measured = []
        for prompt in prompts:
            before = folder_bytes(store)
            peak, per_group = prefill_blocks(producer, prompt)
            measured.append((peak, per_group, folder_bytes(store) - before))
        del producer
        release_memory()
        consumer = LLM(str(model_dir), **llm_args, kv_transfer_config=storage("kv_consumer", store))
        for prompt, (peak, per_group, stored) in zip(prompts, measured):
            before = consumer.stats["kv_load_bytes"]
            consumer.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(temperature=0, max_tokens=1))
            rows.append(BlocksRow(name, len(prompt), peak, per_group, peak * block_nbytes,
                                  sum(per_group) * block_nbytes,
                                  consumer.stats["kv_load_bytes"] - before, stored))
        del consumer
        release_memory()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return rows


def failed_positions(share: float | None, loaded_blocks: int, seed: int) -> list[int]:
    """The prompt's block positions a scenario fails (None: the last loaded block)."""
    if share is None:
        return [loaded_blocks - 1]
    count = round(share * loaded_blocks)
    return sorted(torch.randperm(loaded_blocks, generator=torch.Generator().manual_seed(seed))
                  [:count].tolist())


def fault_rules(run_index: int, batch: int, positions: list[int],
                groups: tuple[KVCacheGroup, ...], loaded_tokens: int) -> list[dict]:
    """Rules failing block `positions` of the prompt in every group that loads them, for
    the run's requests (a windowed group loads from `first_loaded_block` on only)."""
    rules = []
    for g, group in enumerate(groups):
        start = group.first_loaded_block(loaded_tokens, BLOCK_SIZE)
        blocks = [p - start for p in positions if p >= start]
        if blocks:
            rules += [{"requests": run_index * batch + i, "blocks": blocks, "kind": "missing",
                       "group": g} for i in range(batch)]
    return rules


def recovery_ttft(model_dir: Path, llm_args: dict, args: argparse.Namespace) -> list[RecoveryRow]:
    """Part 2: TTFT and tokens recomputed per scenario, block-precise against from-0."""
    store = Path(tempfile.mkdtemp(prefix="kvrecover_windowed_faults_"))
    rounds = [random_prompts(args.batch, args.recovery_tokens, args.seed + 100 + r)
              for r in range(args.repeats)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    try:
        producer = LLM(str(model_dir), **llm_args, kv_transfer_config=storage("kv_producer", store))
        expected = [[o.outputs[0].token_ids for o in producer.generate(
            [{"prompt_token_ids": p} for p in prompts], params)] for prompts in rounds]
        groups = producer.engine.scheduler.kv_manager.groups
        del producer
        release_memory()
        loaded_blocks = (args.recovery_tokens - 1) // BLOCK_SIZE  # the last token is computed
        runs = [(r, label) for r in range(args.repeats) for label in SCENARIOS]
        positions = {label: failed_positions(share, loaded_blocks, args.seed)
                     for label, share in SCENARIOS.items()}
        rules = []
        for run_index, (_, label) in enumerate(runs):
            rules += fault_rules(run_index, args.batch, positions[label], groups,
                                 loaded_blocks * BLOCK_SIZE)
        for recovery, label, ttft, recomputed in time_recovery_rules(
                model_dir, llm_args, store, rules, runs, rounds, expected, args):
            first = positions[label][0] * BLOCK_SIZE if positions[label] else None
            rows.append(RecoveryRow(recovery, label, first, ttft, recomputed))
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return rows


def time_recovery_rules(model_dir: Path, llm_args: dict, store: Path, rules: list[dict],
                        runs: list[tuple[int, str]], rounds: list[list[list[int]]],
                        expected: list[list[list[int]]], args: argparse.Namespace,
                        **transfer_options: Any) -> list[tuple[str, str, float, int]]:
    """(recovery, scenario, best TTFT s, tokens recomputed) for block-precise recovery and
    recompute-from-0, each a consumer of `store` under the fault `rules`, run i loading
    round `runs[i][0]` (`args.batch` prompts, `args.max_tokens` new); outputs must equal
    `expected` (the producer's) or it raises. `transfer_options`: more KVTransferConfig
    fields of the consumers."""
    rows: list[tuple[str, str, float, int]] = []
    for recovery in ("block-precise", "from-0 (vLLM)"):
        llm = LLM(str(model_dir), **llm_args, kv_transfer_config=KVTransferConfig(
            "FaultInjectionConnector", "kv_consumer", {
                "inner_connector": "SharedStorageConnector",
                "shared_storage_path": str(store), "faults": rules}, **transfer_options))
        if recovery.startswith("from-0"):
            llm.engine.scheduler.kv_loads.recovery.__class__ = RecomputeFromZero
        timed_batch(llm, random_prompts(args.batch, 48, seed=999), 2)  # warm-up, no load
        best: dict[str, tuple[str, str, float, int]] = {}
        for round_index, label in runs:
            before = llm.stats["kv_load_recomputed_tokens"]
            outputs: list[list[int]] = []
            ttft = timed_batch(llm, rounds[round_index], args.max_tokens, outputs)[0]
            if outputs != expected[round_index]:
                raise RuntimeError(f"{recovery}, {label} failed: outputs differ from the "
                                   f"failure-free run's\n{outputs}\n{expected[round_index]}")
            recomputed = llm.stats["kv_load_recomputed_tokens"] - before
            if label not in best or ttft < best[label][2]:
                best[label] = (recovery, label, ttft, recomputed)
        rows += best.values()
        del llm
        release_memory()
    return rows


def decode_roofline(name: str, model_dir: Path, args: argparse.Namespace, ceilings: dict) -> dict:
    """Part 3: decode tok/s of one model and its roofline (weights + the KV it reads)."""
    config = json.loads((model_dir / "config.json").read_text())
    batch, prompt_len, new = args.decode_batch, args.decode_prompt, args.decode_tokens
    llm = LLM(str(model_dir), device="cuda:0", dtype="bfloat16", enable_prefix_caching=False,
              max_model_len=prompt_len + new + 16, kv_cache_memory_gb=16,
              max_num_seqs=max(batch, 16))

    def run(seed: int, max_tokens: int, llm: LLM = llm) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in random_prompts(batch, prompt_len, seed)],
                     params)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(1, new)  # warm-up: compiles, captures graphs
    prefill_s = min(run(2 + i, 1) for i in range(2))
    replays = _time_graph_replays(llm.engine.model_runner.graphs)
    result = _rates(batch, prompt_len, new, prefill_s, run(9, new))
    full_steps = sorted(s.elapsed_time(e) for size, s, e in replays if size == batch)
    if full_steps:
        result["decode_gpu_ms_per_step"] = full_steps[len(full_steps) // 2]
    del run, llm  # `run` holds the engine too
    release_memory()
    context = prompt_len + new / 2
    kv_per_layer_token = 2 * config["num_key_value_heads"] * config["head_dim"] * 2  # K+V bf16
    window = config["sliding_window"]
    kv_tokens = sum(min(context, window) if kind == "sliding_attention" else context
                    for kind in config["layer_types"])
    weight_bytes = (model_dir / "model.safetensors").resolve().stat().st_size
    step_bytes = weight_bytes + batch * kv_tokens * kv_per_layer_token
    roof = batch * ceilings["copy_bytes_per_s"] / step_bytes
    return {"model": name, "batch": batch, "prompt_tokens": prompt_len, **result,
            "step_bytes": step_bytes, "roofline_decode_tok_s": roof,
            "pct_of_roofline": 100 * result["decode_tok_s"] / roof}


def print_tables(blocks: list[BlocksRow], recovery: list[RecoveryRow], decode: list[dict]) -> None:
    full = {r.prompt_tokens: r for r in blocks if r.model == "full"}
    print("\n| model | prompt | prefill peak blocks (MiB, x full) | decode blocks per group "
          "(MiB, x full) | MiB loaded (x full) | MiB stored |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for r in blocks:
        ref = full[r.prompt_tokens]
        print(f"| {r.model} | {r.prompt_tokens} | {r.peak_blocks} ({r.peak_bytes / 2**20:.1f}, "
              f"{r.peak_bytes / ref.peak_bytes:.2f}) | {r.decode_blocks_per_group} "
              f"({r.decode_bytes / 2**20:.1f}, {r.decode_bytes / ref.decode_bytes:.2f}) "
              f"| {r.loaded_bytes / 2**20:.1f} ({r.loaded_bytes / ref.loaded_bytes:.2f}) "
              f"| {r.stored_bytes / 2**20:.1f} |")
    print("\n| recovery | failed blocks | first failed token | TTFT s | recomputed tokens |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in recovery:
        first = "-" if row.first_failed_token is None else row.first_failed_token
        print(f"| {row.recovery} | {row.scenario} | {first} | {row.ttft_s:.3f} "
              f"| {row.recomputed_tokens} |")
    if decode:
        print("\n| model | batch | prompt | decode tok/s | roofline tok/s | % roofline |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for d in decode:
            print(f"| {d['model']} | {d['batch']} | {d['prompt_tokens']} | "
                  f"{d['decode_tok_s']:,.0f} | {d['roofline_decode_tok_s']:,.0f} "
                  f"| {d['pct_of_roofline']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default=None, choices=["tiny", "gemma3-1b"],
                        help="tiny (CPU default) or gemma3-1b, bench/gemma3_shape (CUDA default)")
    parser.add_argument("--window", type=int, default=None, help="sliding window (shape's)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="prompt lengths of part 1 (CPU 512 2048; CUDA 2048 8192 32768)")
    parser.add_argument("--recovery-tokens", type=int, default=None,
                        help="prompt length of part 2 (the largest of --lengths)")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="max_num_batched_tokens: the prefill chunk (CPU 256, CUDA 2048)")
    parser.add_argument("--batch", type=int, default=1, help="requests per run of part 2")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="part 2: best of N")
    parser.add_argument("--no-batch-invariant", action="store_true",
                        help="CUDA parts 1-2 on the default kernels (recovered outputs may then "
                             "differ in bf16 and the check fails)")
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-prompt", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the checkpoints go (/tmp/kvrecover-bench-windowed-...)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("kvrecover").setLevel(logging.ERROR)  # one warning per failed block
    cuda = args.device == "cuda"
    args.shape = args.shape or ("gemma3-1b" if cuda else "tiny")
    args.lengths = args.lengths or ([2048, 8192, 32768] if cuda else [512, 2048])
    args.recovery_tokens = args.recovery_tokens or max(args.lengths)
    folder = args.model_dir or Path(
        f"/tmp/kvrecover-bench-windowed-{args.shape}-w{args.window or 'default'}")
    dirs = write_checkpoints(folder, args.shape, args.window, args.device)
    max_len = max(args.lengths + [args.recovery_tokens]) + args.max_tokens + 16
    llm_args = dict(device="cuda:0", dtype="bfloat16", kv_cache_memory_gb=16, enforce_eager=True,
                    batch_invariant=not args.no_batch_invariant,
                    ) if cuda else dict(device="cpu", dtype="float32")
    llm_args.update(block_size=BLOCK_SIZE, max_model_len=max_len, enable_prefix_caching=False,
                    max_num_batched_tokens=args.chunk_tokens or (2048 if cuda else 256))
    blocks = [row for name, path in dirs.items()
              for row in blocks_and_bytes(name, path, llm_args, args.lengths, args.seed)]
    recovery = recovery_ttft(dirs["windowed"], llm_args, args)
    decode = []
    if cuda:
        ceilings = device_ceilings()
        decode = [decode_roofline(name, path, args, ceilings) for name, path in dirs.items()]
    window = json.loads((dirs["windowed"] / "config.json").read_text())["sliding_window"]
    print(f"\nGemma 3 shape '{args.shape}', window {window}, {args.device}, block {BLOCK_SIZE}, "
          f"chunk {llm_args['max_num_batched_tokens']}; part 2: {args.batch} x {args.recovery_tokens} tokens, best of {args.repeats}")
    print_tables(blocks, recovery, decode)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "blocks": [asdict(r) for r in blocks],
                                        "recovery": [asdict(r) for r in recovery],
                                        "decode": decode}, indent=2))


if __name__ == "__main__":
    main()
