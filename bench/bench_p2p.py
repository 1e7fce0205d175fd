"""P2P KV transfer benchmark: a batch's time to first token when its KV is pulled over
NIXL, loaded from the shared-storage connector's folder, or recomputed, in one run.

    PYTHONPATH=.:bench python bench/bench_p2p.py [--batch 16] [--prompt-tokens 1024] \
        [--model-dir DIR] [--repeats 2] [--used-producer]
    PYTHONPATH=.:bench python bench/bench_p2p.py --device cuda --shape 8b

The producer is a process of its own (`--serve`, started here): it prefills the batch
(max_tokens 1) with the NixlConnector and keeps its blocks for one pull; so is each row
(`--row`: its engines in a fresh process). Each row is the best of --repeats (fresh
prompts each, a fresh producer for each NIXL repeat):
the consumer's TTFT of the whole batch (greedy, max_tokens 1: every request's first
token), the KV tokens it did not compute, and those tokens per second of TTFT. Every
engine is warmed up first with a prompt of its own (kernels compiled, graphs captured);
the NIXL consumer pulls its warm-up prompt from the producer (the handshake, and on a GPU
the opening of the producer's memory, happen once per peer: not in the timed pull).
`--used-producer`: the producer first prefills and frees (not kept) twice the batch, as
one that has served a while: it then hands the timed prompts their blocks in the order
they were freed, a request's tail first (descending producer ids), not in fresh order.

CPU (the default): NIXL moves CPU memory through UCX on loopback; the default model is
the built-in one (float32). CUDA: both processes on the one GPU, KV in GPU memory (UCX's
cuda_ipc), bf16 weights of `--model-dir`, else random ones of `--shape` (1b or 8b:
`model_shapes.py`). The NIXL row's READ and check times come from the consumer's
counters (`kv_nixl_read_*`, `kv_nixl_check_microseconds`), and a device-to-device copy
of as many bytes is timed in the same run: the pull's bandwidth against it.
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


WARM_UP = prompts_for(1, 64, seed=1 << 20)[0]  # shares no block with the timed prompts


def warmed_engine(args, transfer: KVTransferConfig | None,
                  warm_up_reference: dict | None = None) -> tuple[LLM, dict | None]:
    """An engine of the run's model and device, warmed up with a prompt of its own (a
    NIXL consumer pulls it with `warm_up_reference`: the first pull from a producer
    opens its memory, once per peer); its warm-up output's `kv_transfer_params`."""
    device = {"device": "cpu"} if args.device == "cpu" else {
        "device": "cuda:0", "dtype": "bfloat16",
        "max_model_len": args.prompt_tokens + 16}
    llm = LLM(args.model_dir, kv_transfer_config=transfer, max_num_seqs=args.batch,
              enable_prefix_caching=False,
              num_kv_blocks=2 * args.batch * (args.prompt_tokens // 16 + 2) + 16, **device)
    params = SamplingParams(temperature=0, max_tokens=1)
    params.kv_transfer_params = warm_up_reference
    warm_up = llm.generate([{"prompt_token_ids": WARM_UP}], params)[0]
    return llm, warm_up.kv_transfer_params


def engine(args, transfer: KVTransferConfig | None) -> LLM:
    """`warmed_engine`'s engine."""
    return warmed_engine(args, transfer)[0]


def serve(args, port: int, prompts_file: str) -> None:
    """The producer process: prefill, print the references, serve until stdin closes."""
    prompts = json.loads(Path(prompts_file).read_text())
    transfer = KVTransferConfig("NixlConnector", "kv_producer", {"side_channel_port": port})
    llm, warm_up = warmed_engine(args, transfer)
    if args.used_producer:
        not_kept = SamplingParams(temperature=0, max_tokens=1)
        not_kept.kv_transfer_params = {"do_remote_decode": False}
        llm.generate([{"prompt_token_ids": p} for p in prompts_for(
            2 * args.batch, args.prompt_tokens, seed=1 << 21)], not_kept)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], FIRST_TOKEN)
    print("REFS", json.dumps({"warm_up": warm_up,
                              "prompts": [o.kv_transfer_params for o in outputs]}), flush=True)
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


def timed(llm: LLM, prompts: list[list[int]], params) -> tuple[float, list[list[int]], dict]:
    """The batch's TTFT, its token ids, and the engine's counters it added (the warm-up's
    left out)."""
    before = dict(llm.stats)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - started
    added = {name: count - before.get(name, 0) for name, count in llm.stats.items()}
    return seconds, [o.outputs[0].token_ids for o in outputs], added


NIXL_COUNTERS = ("kv_nixl_read_bytes", "kv_nixl_read_microseconds",
                 "kv_nixl_check_microseconds")


def nixl_row(args, prompts: list[list[int]], work: Path) -> tuple[float, int, list, dict]:
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    command = [sys.executable, __file__, "--serve", str(free_port()), str(prompts_file),
               *common_args(args)]
    producer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=child_env())
    try:
        assert producer.stdout is not None
        references = next(json.loads(line[5:]) for line in producer.stdout
                          if line.startswith("REFS "))
        consumer, _ = warmed_engine(args, KVTransferConfig("NixlConnector", "kv_consumer"),
                                    references["warm_up"])
        params = []
        for reference in references["prompts"]:
            each = SamplingParams(temperature=0, max_tokens=1)
            each.kv_transfer_params = reference
            params.append(each)
        seconds, ids, added = timed(consumer, prompts, params)
        consumer.close()
        return (seconds, added.get("prompt_tokens_external", 0), ids,
                {name: added.get(name, 0) for name in NIXL_COUNTERS})
    finally:
        producer.communicate("", timeout=60)


def storage_row(args, prompts: list[list[int]], work: Path) -> tuple[float, int, list, dict]:
    folder = {"shared_storage_path": str(work / "store")}
    producer = engine(args, KVTransferConfig("SharedStorageConnector", "kv_producer", folder))
    producer.generate([{"prompt_token_ids": p} for p in prompts], FIRST_TOKEN)
    producer.close()
    consumer = engine(args, KVTransferConfig("SharedStorageConnector", "kv_consumer", folder))
    seconds, ids, added = timed(consumer, prompts, FIRST_TOKEN)
    consumer.close()
    return seconds, added.get("prompt_tokens_external", 0), ids, {}


def recompute_row(args, prompts: list[list[int]], work: Path) -> tuple[float, int, list, dict]:
    llm = engine(args, None)
    seconds, ids, _ = timed(llm, prompts, FIRST_TOKEN)
    llm.close()
    return seconds, 0, ids, {}


ROWS = {"recompute": recompute_row, "shared storage": storage_row, "NIXL pull": nixl_row}


def common_args(args) -> list[str]:
    """The arguments a child process of this bench (a row, a producer) shares."""
    command = ["--batch", str(args.batch), "--prompt-tokens", str(args.prompt_tokens),
               "--device", args.device] + (["--used-producer"] if args.used_producer else [])
    return command + (["--model-dir", args.model_dir] if args.model_dir else [])


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def run_row(args, name: str, seed: int, work: Path) -> tuple[float, int, list, dict]:
    """Row `name` in a process of its own, as each instance is when deployed: no row
    inherits another's threads, allocator state or caches."""
    command = [sys.executable, __file__, "--row", name, str(seed), str(work),
               *common_args(args)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=child_env(),
                          check=True, timeout=1800)
    result = json.loads(next(line[4:] for line in reversed(done.stdout.splitlines())
                             if line.startswith("ROW ")))
    return result["seconds"], result["loaded"], result["ids"], result["counters"]


def device_copy_seconds(nbytes: int, repeats: int = 5) -> float:
    """The best time of a device-to-device copy of `nbytes` on the GPU."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    del source, target
    torch.cuda.empty_cache()
    return best


def print_pull(counters: dict[str, int]) -> None:
    """The NIXL row's READ and check, as bandwidth (and against a D2D copy on a GPU)."""
    nbytes = counters["kv_nixl_read_bytes"]
    read_s = counters["kv_nixl_read_microseconds"] / 1e6
    check_s = counters["kv_nixl_check_microseconds"] / 1e6
    if not nbytes or not read_s:
        print("NIXL pull: no READ counted")
        return
    print(f"\nNIXL pull of {nbytes / 1e9:.2f} GB: READ {read_s * 1e3:.1f} ms "
          f"({nbytes / read_s / 1e9:.1f} GB/s), check {check_s * 1e3:.1f} ms, READ + check "
          f"{nbytes / (read_s + check_s) / 1e9:.1f} GB/s")
    if torch.cuda.is_available() and counters.get("device") == "cuda":
        copy_s = device_copy_seconds(nbytes)
        print(f"device-to-device copy of as many bytes: {copy_s * 1e3:.2f} ms "
              f"({nbytes / copy_s / 1e9:.1f} GB/s); READ {copy_s / read_s:.2f}x of it, "
              f"READ + check {copy_s / (read_s + check_s):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=["1b", "8b"], default=None,
                        help="CUDA: random bf16 weights of this shape (default 1b) where "
                             "--model-dir holds no checkpoint")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-storage", action="store_true",
                        help="leave out the shared-storage row")
    parser.add_argument("--used-producer", action="store_true",
                        help="the producer first serves and frees twice the batch")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "PROMPTS_JSON"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--row", nargs=3, metavar=("NAME", "SEED", "WORK_DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not args.serve:
        from model_shapes import resolve_model_dir  # bench/ is on sys.path

        args.model_dir = str(resolve_model_dir(
            None if args.model_dir is None else Path(args.model_dir), args.shape))
    elif args.shape is not None:
        raise SystemExit("--shape writes random weights on the GPU: give --device cuda")
    if args.serve:
        serve(args, int(args.serve[0]), args.serve[1])
        return
    if args.row:
        name, seed, work = args.row
        seconds, loaded, ids, counters = ROWS[name](
            args, prompts_for(args.batch, args.prompt_tokens, int(seed)), Path(work))
        print("ROW", json.dumps({"seconds": seconds, "loaded": loaded, "ids": ids,
                                 "counters": counters}), flush=True)
        return
    best: dict[str, tuple[float, int, dict]] = {}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            expected = None
            for name in ROWS:
                if name == "shared storage" and args.skip_storage:
                    continue
                work = Path(root) / f"{repeat}-{name.replace(' ', '_')}"
                work.mkdir()
                seconds, loaded, ids, counters = run_row(args, name, repeat, work)
                if expected is None:
                    expected = ids
                elif ids != expected:
                    raise SystemExit(f"{name}: the first tokens differ from recomputing")
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, loaded, counters)
    recompute = best["recompute"][0]
    where = "CPU" if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"\n{args.batch} x {args.prompt_tokens} tokens, {where}, best of {args.repeats}")
    print(f"{'path':<16}{'TTFT s':>9}{'vs recompute':>14}{'KV tokens':>11}{'KV tok/s':>11}")
    for name, (seconds, loaded, _) in best.items():
        rate = f"{loaded / seconds:>11.0f}" if loaded else f"{'-':>11}"
        print(f"{name:<16}{seconds:>9.3f}{seconds / recompute:>13.2f}x{loaded:>11}{rate}")
    print_pull({**best["NIXL pull"][2], "device": args.device})


if __name__ == "__main__":
    main()
