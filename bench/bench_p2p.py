"""P2P KV transfer benchmark: a batch's time to first token when its KV is pulled over
NIXL, loaded from the shared-storage connector's folder, or recomputed, in one run.

    PYTHONPATH=. python bench/bench_p2p.py [--batch 16] [--prompt-tokens 1024] \
        [--model-dir DIR] [--repeats 2]

The producer is a process of its own (`--serve`, started here): it prefills the batch
(max_tokens 1) with the NixlConnector and keeps its blocks for one pull. Each row is
the best of --repeats (fresh prompts each, a fresh producer for each NIXL repeat):
the consumer's TTFT of the whole batch (greedy, max_tokens 1: every request's first
token), the KV tokens it did not compute, and those tokens per second of TTFT. CPU
only: NIXL moves CPU memory through UCX on loopback. The default model is the
built-in one (float32).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvrecover import LLM, KVTransferConfig, SamplingParams

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def prompts_for(batch: int, tokens: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 20000, (batch, tokens), generator=generator).tolist()


def engine(model: str | None, transfer: KVTransferConfig | None, batch: int,
           tokens: int) -> LLM:
    return LLM(model, device="cpu", kv_transfer_config=transfer, max_num_seqs=batch,
               enable_prefix_caching=False,
               num_kv_blocks=2 * batch * (tokens // 16 + 2) + 16)


def serve(model: str | None, port: int, prompts_file: str, batch: int, tokens: int) -> None:
    """The producer process: prefill, print the references, serve until stdin closes."""
    prompts = json.loads(Path(prompts_file).read_text())
    transfer = KVTransferConfig("NixlConnector", "kv_producer", {"side_channel_port": port})
    llm = engine(model, transfer, batch, tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], FIRST_TOKEN)
    print("REFS", json.dumps([o.kv_transfer_params for o in outputs]), flush=True)
    end = time.monotonic() + 600
    while time.monotonic() < end:
        if llm.engine.has_unfinished():
            llm.engine.step()
        idle = not llm.engine.has_unfinished() or llm.engine.awaits_only_sends()
        if select.select([sys.stdin], [], [], 0.01 if idle else 0)[0] \
                and not sys.stdin.readline():
            break
    llm.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def timed(llm: LLM, prompts: list[list[int]], params) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - started, [o.outputs[0].token_ids for o in outputs]


def nixl_row(args, prompts: list[list[int]], work: Path) -> tuple[float, int, list]:
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    command = [sys.executable, __file__, "--serve", str(free_port()), str(prompts_file),
               "--batch", str(args.batch), "--prompt-tokens", str(args.prompt_tokens)]
    if args.model_dir:
        command += ["--model-dir", args.model_dir]
    producer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert producer.stdout is not None
        references = next(json.loads(line[5:]) for line in producer.stdout
                          if line.startswith("REFS "))
        consumer = engine(args.model_dir, KVTransferConfig("NixlConnector", "kv_consumer"),
                          args.batch, args.prompt_tokens)
        params = []
        for reference in references:
            each = SamplingParams(temperature=0, max_tokens=1)
            each.kv_transfer_params = reference
            params.append(each)
        seconds, ids = timed(consumer, prompts, params)
        loaded = consumer.stats["prompt_tokens_external"]
        consumer.close()
        return seconds, loaded, ids
    finally:
        producer.communicate("", timeout=60)


def storage_row(args, prompts: list[list[int]], work: Path) -> tuple[float, int, list]:
    folder = {"shared_storage_path": str(work / "store")}
    producer = engine(args.model_dir, KVTransferConfig("SharedStorageConnector", "kv_producer",
                                                       folder), args.batch, args.prompt_tokens)
    producer.generate([{"prompt_token_ids": p} for p in prompts], FIRST_TOKEN)
    producer.close()
    consumer = engine(args.model_dir, KVTransferConfig("SharedStorageConnector", "kv_consumer",
                                                       folder), args.batch, args.prompt_tokens)
    seconds, ids = timed(consumer, prompts, FIRST_TOKEN)
    loaded = consumer.stats["prompt_tokens_external"]
    consumer.close()
    return seconds, loaded, ids


def recompute_row(args, prompts: list[list[int]], work: Path) -> tuple[float, int, list]:
    llm = engine(args.model_dir, None, args.batch, args.prompt_tokens)
    seconds, ids = timed(llm, prompts, FIRST_TOKEN)
    llm.close()
    return seconds, 0, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "PROMPTS_JSON"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.model_dir, int(args.serve[0]), args.serve[1], args.batch, args.prompt_tokens)
        return
    rows = {"recompute": recompute_row, "shared storage": storage_row, "NIXL pull": nixl_row}
    best: dict[str, tuple[float, int]] = {}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            prompts = prompts_for(args.batch, args.prompt_tokens, seed=repeat)
            expected = None
            for name, row in rows.items():
                work = Path(root) / f"{repeat}-{name.replace(' ', '_')}"
                work.mkdir()
                seconds, loaded, ids = row(args, prompts, work)
                if expected is None:
                    expected = ids
                elif ids != expected:
                    raise SystemExit(f"{name}: the first tokens differ from recomputing")
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, loaded)
    recompute = best["recompute"][0]
    print(f"\n{args.batch} x {args.prompt_tokens} tokens, CPU, best of {args.repeats}")
    print(f"{'path':<16}{'TTFT s':>9}{'vs recompute':>14}{'KV tokens':>11}{'KV tok/s':>11}")
    for name, (seconds, loaded) in best.items():
        rate = f"{loaded / seconds:>11.0f}" if loaded else f"{'-':>11}"
        print(f"{name:<16}{seconds:>9.2f}{seconds / recompute:>13.2f}x{loaded:>11}{rate}")


if __name__ == "__main__":
    main()
