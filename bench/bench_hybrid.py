"""Hybrid (Qwen3-Next) benchmark, CPU part of issue 23: recovery TTFT and bytes stored.

    PYTHONPATH=. python bench/bench_hybrid.py [--batch 4] [--prompt-tokens 512] [--repeats 2]
        [--held-prefix 256] [--state-checkpoints N] [--state-interval K]

Two random float32 checkpoints of equal dims (hidden 256, 4 layers): a Qwen3-Next hybrid
(3 linear-attention layers + 1 full, 4 experts) and a Qwen3 whose 4 layers are all full
attention (same heads, KV heads and head_dim).

1. Time to first token of a batch whose KV and recurrent states a producer stored
   (`SharedStorageConnector`), loaded through a `FaultInjectionConnector` that fails
   0 / 10 / 100 % of each request's loaded KV blocks ("missing", seeded positions), its
   middle or last loaded block, or only its state entry; block-precise recovery (rule 8:
   back to the last boundary whose KV and state are to be had: the producer stored a
   state every `--state-interval` K blocks, `state_interval_blocks`, and a failed load
   keeps the stored one at or before its first failed block) against recompute-from-0 (vLLM's rule,
   bench_windowed's `RecomputeFromZero`). Every run has fresh prompts, so the consumer holds no state
   checkpoint of them from an earlier run. Outputs must equal the producer's token for
   token.
   1b. Prefix caching on, the consumer first computes each prompt's first
   `--held-prefix` tokens itself, then loads the rest with the last loaded block or the
   state failed: rule 8 rolls back to a state checkpoint the consumer still holds
   (`num_state_checkpoints` slots, LRU, one per block boundary computed), from-0 to 0.
2. Bytes stored per prompt token (the store folder's size; state chunks found by their
   keys) for the same prompts, hybrid (states every K blocks and at the last loadable
   boundary) against the all-full model.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_recovery import random_prompts, release_memory, timed_batch
from bench_windowed import (
    RecomputeFromZero,
    failed_positions,
    folder_bytes,
    storage,
    time_recovery_rules,
)
from model_shapes import write_word_tokenizer
from random_checkpoint import write_random_checkpoint

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.kv_layout import group_block_key, hash_block_tokens
from kvrecover.kv_transfer.stores.block_store import SUFFIX
from kvrecover.kv_transfer.stores.state_entries import STATE_KEY_GROUP

BLOCK_SIZE = 16
# Share of each request's loaded KV blocks that fail (seeded positions); None: the last
# loaded block only; "state": the state entry only, every KV block loads.
SCENARIOS: dict[str, float | str | None] = {"0%": 0.0, "10%": 0.1, "100%": 1.0,
                                            "middle block": "middle", "last block": None,
                                            "state only": "state"}
DIMS = dict(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
            tie_word_embeddings=False)
HYBRID = dict(layer_types=["linear_attention"] * 3 + ["full_attention"],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
              linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=256,
              shared_expert_intermediate_size=256)


@dataclass
class TTFTRow:
    """Part 1: one recovery rule under one failure scenario (best TTFT of the repeats)."""

    recovery: str
    scenario: str
    ttft_s: float
    recomputed_tokens: int


@dataclass
class BytesRow:
    """Part 2: what one model's producer stored for the batch."""

    model: str
    prompt_tokens: int
    kv_bytes: int
    state_bytes: int


def write_hybrid(folder: Path) -> Path:
    """The random Qwen3-Next checkpoint; weights scaled as in the hybrid tests (peaked,
    varied greedy outputs; decays in range)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "model.safetensors").is_file():
        return folder
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("qwen3_next", **DIMS, **HYBRID), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.08)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    write_word_tokenizer(folder, DIMS["vocab_size"], DIMS["eos_token_id"])
    return folder


def write_full(folder: Path) -> Path:
    """The all-full-attention Qwen3 twin (same dims, its own random weights)."""
    if not (folder / "model.safetensors").is_file():
        write_random_checkpoint({"model_type": "qwen3", **DIMS}, folder, dtype="float32")
        write_word_tokenizer(folder, DIMS["vocab_size"], DIMS["eos_token_id"])
    return folder


def fault_rules(run_index: int, batch: int, positions: list[int] | None) -> list[dict]:
    """The run's requests fail KV block `positions` (None: their state entry only)."""
    if positions is None:
        return [{"requests": run_index * batch + i, "target": "state", "kind": "missing"}
                for i in range(batch)]
    if not positions:
        return []
    return [{"requests": run_index * batch + i, "blocks": positions, "kind": "missing"}
            for i in range(batch)]


def state_files(store: Path, prompt: list[int]) -> list[Path]:
    """The stored chunks of `prompt`'s states (at any block boundary): chunk i of the
    state at a boundary is keyed by its chain hash and STATE_KEY_GROUP + i."""
    block_hash = None
    files: list[Path] = []
    for start in range(0, (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE, BLOCK_SIZE):
        block_hash = hash_block_tokens(block_hash, prompt[start:start + BLOCK_SIZE])
        for index in itertools.count():
            key = group_block_key(block_hash, STATE_KEY_GROUP + index)
            found = list(store.rglob(f"{key.hex()}{SUFFIX}"))
            if not found:
                break
            files += found
    return files


def stored_bytes(store: Path, prompts: list[list[int]]) -> tuple[int, int]:
    """(KV bytes, state bytes) of a store folder holding `prompts`."""
    state = sum(f.stat().st_size for prompt in prompts for f in state_files(store, prompt))
    return folder_bytes(store) - state, state


def produce(model_dir: Path, llm_args: dict, store: Path, rounds: list[list[list[int]]],
            params: SamplingParams, interval: int) -> list[list[list[int]]]:
    """Prefill every round into `store`; the generated ids per round."""
    transfer = storage("kv_producer", store)
    transfer.state_interval_blocks = interval
    producer = LLM(str(model_dir), **llm_args, kv_transfer_config=transfer)
    outputs = [[o.outputs[0].token_ids for o in producer.generate(
        [{"prompt_token_ids": p} for p in prompts], params)] for prompts in rounds]
    del producer
    release_memory()
    return outputs


def recovery_ttft(model_dir: Path, llm_args: dict, store: Path, rounds: list[list[list[int]]],
                  expected: list[list[list[int]]], args: argparse.Namespace) -> list[TTFTRow]:
    """Part 1: both recovery rules, run i on stored round i (scenario, repeat)."""
    loaded_blocks = (args.prompt_tokens - 1) // BLOCK_SIZE  # the last token is computed
    positions = {label: None if share == "state" else [loaded_blocks // 2]
                 if share == "middle" else failed_positions(share, loaded_blocks, args.seed)
                 for label, share in SCENARIOS.items()}
    runs = list(enumerate(label for _ in range(args.repeats) for label in SCENARIOS))
    rules = [rule for index, label in runs
             for rule in fault_rules(index, args.batch, positions[label])]
    return [TTFTRow(*row) for row in time_recovery_rules(
        model_dir, llm_args, store, rules, runs, rounds, expected, args,
        state_interval_blocks=args.state_interval)]


def held_prefix_ttft(model_dir: Path, llm_args: dict, store: Path,
                     rounds: list[list[list[int]]], expected: list[list[list[int]]],
                     args: argparse.Namespace) -> list[TTFTRow]:
    """Part 1b: prefix caching on, the consumer first computes each prompt's first
    `--held-prefix` tokens itself (their boundaries get state checkpoints), then loads
    the whole prompt (its tail from the store) with the last loaded block or the state
    failed in every request: block-precise may roll back to the held checkpoint."""
    rows = []
    for label, rule in (("last block, prefix held", {"blocks": "last"}),
                        ("state only, prefix held", {"target": "state"})):
        for recovery in ("block-precise", "from-0 (vLLM)"):
            llm = LLM(str(model_dir), **{**llm_args, "enable_prefix_caching": True},
                      kv_transfer_config=KVTransferConfig(
                          "FaultInjectionConnector", "kv_consumer", {
                              "inner_connector": "SharedStorageConnector",
                              "shared_storage_path": str(store),
                              "faults": [{"requests": "all", "kind": "missing", **rule}]},
                          state_interval_blocks=args.state_interval))
            if recovery.startswith("from-0"):
                llm.engine.scheduler.kv_loads.recovery.__class__ = RecomputeFromZero
            best = None
            for prompts, wanted in list(zip(rounds, expected))[:args.repeats]:
                timed_batch(llm, [p[:args.held_prefix] for p in prompts], 1)
                before = (llm.stats["kv_load_recomputed_tokens"],
                          llm.stats["prefix_cache_hit_tokens"])
                outputs: list[list[int]] = []
                ttft = timed_batch(llm, prompts, args.max_tokens, outputs)[0]
                if outputs != wanted:
                    raise RuntimeError(f"{recovery}, {label}: outputs differ from the producer's")
                if llm.stats["prefix_cache_hit_tokens"] == before[1]:
                    raise RuntimeError(f"{label}: the held prefix was not reused")
                recomputed = llm.stats["kv_load_recomputed_tokens"] - before[0]
                if best is None or ttft < best.ttft_s:
                    best = TTFTRow(recovery, label, ttft, recomputed)
            rows.append(best)
            del llm
            release_memory()
    return rows


def print_tables(ttft: list[TTFTRow], stored: list[BytesRow]) -> None:
    print("\n| recovery | failed | TTFT s | recomputed tokens |")
    print("| --- | --- | ---: | ---: |")
    for row in ttft:
        print(f"| {row.recovery} | {row.scenario} | {row.ttft_s:.3f} | {row.recomputed_tokens} |")
    full = next(r for r in stored if r.model == "full")
    full_total = full.kv_bytes + full.state_bytes
    print("\n| model | KV B/token | state B/token | total B/token | x full |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in stored:
        total = r.kv_bytes + r.state_bytes
        print(f"| {r.model} | {r.kv_bytes / r.prompt_tokens:,.0f} | "
              f"{r.state_bytes / r.prompt_tokens:,.0f} | {total / r.prompt_tokens:,.0f} | "
              f"{total / full_total:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=2, help="part 1: best of N")
    parser.add_argument("--held-prefix", type=int, default=256,
                        help="part 1b: tokens the consumer computes itself first")
    parser.add_argument("--state-checkpoints", type=int, default=None,
                        help="num_state_checkpoints of the consumers (the engine's default)")
    parser.add_argument("--state-interval", type=int, default=8,
                        help="state_interval_blocks K of producer and consumers (8: 128 "
                             "tokens; the engine's default, 1024, stores none inside a "
                             "512-token prompt)")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/kvrecover-bench-hybrid"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("kvrecover").setLevel(logging.ERROR)  # one warning per failed block
    hybrid = write_hybrid(args.model_dir / "qwen3_next")
    full = write_full(args.model_dir / "qwen3_full")
    llm_args = dict(device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                    max_model_len=args.prompt_tokens + args.max_tokens + 16,
                    enable_prefix_caching=False, max_num_batched_tokens=args.chunk_tokens)
    if args.state_checkpoints is not None:
        llm_args["num_state_checkpoints"] = args.state_checkpoints
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rounds = [random_prompts(args.batch, args.prompt_tokens, args.seed + 100 + r)
              for r in range(args.repeats * len(SCENARIOS))]
    prompt_tokens = args.batch * args.prompt_tokens
    stored, ttft = [], []
    for name, model_dir in (("qwen3-next hybrid", hybrid), ("full", full)):
        store = Path(tempfile.mkdtemp(prefix="kvrecover_hybrid_"))
        try:
            expected = produce(model_dir, llm_args, store, rounds[:1], params,
                               args.state_interval)
            stored.append(BytesRow(name, prompt_tokens, *stored_bytes(store, rounds[0])))
            if model_dir == hybrid:
                expected += produce(model_dir, llm_args, store, rounds[1:], params,
                                    args.state_interval)
                ttft = recovery_ttft(model_dir, llm_args, store, rounds, expected, args)
                ttft += held_prefix_ttft(model_dir, llm_args, store, rounds, expected, args)
        finally:
            shutil.rmtree(store, ignore_errors=True)
    print(f"\nQwen3-Next hybrid (hidden 256, 3 linear + 1 full layers, 4 experts), cpu float32, "
          f"block {BLOCK_SIZE}, chunk {args.chunk_tokens}; {args.batch} x {args.prompt_tokens} "
          f"tokens, {args.max_tokens} new, best of {args.repeats}, held prefix {args.held_prefix}, "
          f"state checkpoints {args.state_checkpoints or 'default'}, states every "
          f"{args.state_interval} blocks")
    print_tables(ttft, stored)


if __name__ == "__main__":
    main()
