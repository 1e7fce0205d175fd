"""What tensor parallelism costs per step outside the forward, and size 1 vs 2 on the CPU.

1. The step message: a decode `SchedulerOutput` of B requests (each with a block table
   of `--blocks` blocks) pickled once and written to a rank process over its channel
   (`distributed.rank_process`), the rank answering with a `RankReport`, as
   `TensorParallelRunner.execute` does; against the same bytes sent by a gloo
   broadcast (length, then payload) between the two processes. Median µs per step.
   This is also the price of running rank 0 in a process of its own: one more such
   round trip per step (plus the tokens back).
2. `generate` wall time at tensor_parallel_size 1 and 2 (a tiny random Llama, greedy),
   with the outputs compared.

    PYTHONPATH=. python bench/tensor_parallel_step.py [--batches 1 64] [--steps 200]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from kvrecover.distributed.messages import RankReport, pack, unpack
from kvrecover.sampling import SamplingParams
from kvrecover.step_messages import ScheduledRequest, SchedulerOutput


def decode_step(batch: int, blocks: int) -> SchedulerOutput:
    params = SamplingParams(temperature=0)
    return SchedulerOutput([
        ScheduledRequest(f"request-{i}", [7], blocks * 16 - 3, list(range(i, i + blocks)),
                         True, params, 1000 + i) for i in range(batch)])


def echo(fd: int, port: int) -> None:
    """The rank side: answer each message on the channel with a report, then each gloo
    broadcast, until told to stop."""
    channel = Connection(fd)
    while True:
        message = unpack(channel.recv_bytes())
        if message.kind == "stop":
            break
        channel.send_bytes(pack("report", RankReport()))
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=30))
    length = torch.zeros(1, dtype=torch.int64)
    while True:
        group.broadcast(length, 0).wait()
        if int(length) < 0:
            break
        payload = torch.empty(int(length), dtype=torch.uint8)
        group.broadcast(payload, 0).wait()
        unpack(payload.numpy().tobytes())
        group.barrier().wait()  # the report's place: one round trip back


def measure_messages(batches: list[int], blocks: int, steps: int) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    ours, theirs = socket.socketpair()
    rank = subprocess.Popen([sys.executable, __file__, "--echo", str(theirs.fileno()),
                             str(store.port)], pass_fds=(theirs.fileno(),))
    theirs.close()
    channel = Connection(ours.detach())
    pipe_us: dict[int, float] = {}
    for batch in batches:
        step = decode_step(batch, blocks)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            channel.send_bytes(pack("step", step))
            unpack(channel.recv_bytes())
            times.append(time.perf_counter() - started)
        pipe_us[batch] = statistics.median(times) * 1e6
    channel.send_bytes(pack("stop"))
    group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=30))
    gloo_us: dict[int, float] = {}
    for batch in batches:
        step = decode_step(batch, blocks)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            payload = pack("step", step)
            group.broadcast(torch.tensor([len(payload)]), 0).wait()
            group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0).wait()
            group.barrier().wait()
            times.append(time.perf_counter() - started)
        gloo_us[batch] = statistics.median(times) * 1e6
    group.broadcast(torch.tensor([-1]), 0).wait()
    rank.wait()
    print(f"step message round trip (median of {steps}, {blocks} blocks per request):")
    for batch in batches:
        size = len(pack("step", decode_step(batch, blocks)))
        print(f"  batch {batch:3d}: {size:7d} bytes; channel + report {pipe_us[batch]:7.1f} µs; "
              f"gloo broadcast + barrier {gloo_us[batch]:7.1f} µs")


def measure_generate(batch: int, prompt_tokens: int, max_tokens: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import build_tiny_model, random_prompts

    from kvrecover import LLM

    with tempfile.TemporaryDirectory() as folder:
        model_dir = build_tiny_model(Path(folder), hidden_size=512, intermediate_size=1536,
                                     num_attention_heads=8, num_key_value_heads=4,
                                     num_hidden_layers=4, vocab_size=2048)
        prompts = [{"prompt_token_ids": p}
                   for p in random_prompts(batch, [prompt_tokens], 2048, seed=1)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        results = {}
        for size in (1, 2):
            started = time.perf_counter()
            with LLM(str(model_dir), device="cpu", tensor_parallel_size=size) as llm:
                ready = time.perf_counter()
                outputs = llm.generate(prompts, params)
                done = time.perf_counter()
            results[size] = [o.outputs[0].token_ids for o in outputs]
            print(f"tensor_parallel_size {size}: start-up {ready - started:.2f} s, generate "
                  f"{batch} x {prompt_tokens} + {max_tokens} tokens {done - ready:.2f} s")
        print("outputs equal:", results[1] == results[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--generate", type=int, nargs=3, default=[8, 128, 32],
                        metavar=("BATCH", "PROMPT", "NEW"))
    parser.add_argument("--echo", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo:
        echo(*args.echo)
        os._exit(0)
    measure_messages(args.batches, args.blocks, args.steps)
    measure_generate(*args.generate)


if __name__ == "__main__":
    main()
