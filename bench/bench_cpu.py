"""CPU benchmark: kvrecover `LLM.generate` against Hugging Face `generate`, same model, same run.

Command (from the repository root; the default model already converted, nothing
else running on the machine):

    .venv/bin/python bench/bench_cpu.py

Workload: the built-in default model (SmolLM2-135M-Instruct) in float32 on the
CPU, 8 token-id prompts of 256 tokens, 64 new greedy tokens each (kvrecover:
`ignore_eos=True`; HF: no EOS id, so both generate exactly 64). Each measured
run uses fresh prompts so kvrecover's prefix cache never helps; one warm-up run
per engine comes first; the best of `--repeats` runs is reported.

Also measured, each in a fresh subprocess: start-up (from `import torch` to an
`LLM` ready to generate, best of 3, split into import torch / import kvrecover /
`LLM()`) and peak memory (ru_maxrss of a process that builds
the `LLM` and runs the workload once).

Targets (issue "Engine core"): generate at least as fast as vLLM's CPU build
(2.3 s on a 2-core machine where HF generate took 6.5 s, i.e. at most 0.35x HF's
time), start-up under 2 s, peak memory under 1.5 GB.

`--profile` adds a cProfile of one kvrecover run and a torch profiler table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VLLM_SECONDS, VLLM_HF_SECONDS = 2.3, 6.5  # the reference figures (2 cores)
STARTUP_TARGET_S = 2.0
MEMORY_TARGET_MB = 1.5 * 1024


def make_prompts(num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Seeded random token ids, clear of the special tokens at the low ids."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49152, (num_prompts, prompt_len), generator=generator).tolist()


def build_llm():
    from kvrecover import LLM

    return LLM(None, device="cpu", dtype="float32")


def run_kvrecover(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from kvrecover import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(requests, params)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert all(len(t) == new_tokens for t in tokens)
    return elapsed, tokens


def build_hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # never stop early: exactly new_tokens
    model.generation_config.pad_token_id = 0
    return model


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    import torch

    input_ids = torch.tensor(prompts)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        elapsed = time.perf_counter() - start
    tokens = out[:, input_ids.shape[1] :].tolist()
    assert all(len(t) == new_tokens for t in tokens)
    return elapsed, tokens


# ----- subprocess measurements ------------------------------------------------------


def child_startup() -> None:
    start = time.perf_counter()
    import torch  # noqa: F401  (timed apart: every torch program pays it)

    torch_done = time.perf_counter()
    import kvrecover  # noqa: F401  (timed: the import is part of start-up)

    import_done = time.perf_counter()
    llm = build_llm()
    ready = time.perf_counter()
    print(json.dumps({
        "startup_s": ready - start, "import_torch_s": torch_done - start,
        "import_kvrecover_s": import_done - torch_done, "llm_init_s": ready - import_done,
        "num_kv_blocks": llm.engine.num_blocks,
    }))


def child_memory(num_prompts: int, prompt_len: int, new_tokens: int) -> None:
    import resource

    llm = build_llm()
    after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run_kvrecover(llm, make_prompts(num_prompts, prompt_len, seed=1), new_tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"peak_rss_mb": peak / 1024, "after_load_rss_mb": after_load / 1024}))


def run_child(args: list[str]) -> tuple[dict, float]:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args],
        capture_output=True, text=True, check=False,
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1]), wall


# ----- profiling ------------------------------------------------------------------------


def profile(llm, num_prompts: int, prompt_len: int, new_tokens: int) -> None:
    import cProfile
    import pstats

    import torch

    prompts = make_prompts(num_prompts, prompt_len, seed=100)
    profiler = cProfile.Profile()
    profiler.enable()
    run_kvrecover(llm, prompts, new_tokens)
    profiler.disable()
    print("\n== cProfile of one kvrecover run (top 25 by own time) ==")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

    prompts = make_prompts(num_prompts, prompt_len, seed=101)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_kvrecover(llm, prompts, new_tokens)
    print("\n== torch profiler of one kvrecover run (top 25 by self CPU time) ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


# ----- main -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also profile kvrecover")
    parser.add_argument("--child", choices=["startup", "memory"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "startup":
        return child_startup()
    if args.child == "memory":
        return child_memory(args.prompts, args.prompt_len, args.new_tokens)

    import torch

    shape = ["--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
             "--new-tokens", str(args.new_tokens)]
    startup, startup_wall = min(
        (run_child(["--child", "startup"]) for _ in range(3)), key=lambda r: r[0]["startup_s"]
    )
    memory, _ = run_child(["--child", "memory", *shape])

    llm = build_llm()
    hf = build_hf(llm.engine.model_dir)
    warm = make_prompts(args.prompts, args.prompt_len, seed=0)
    run_kvrecover(llm, warm, 4)
    run_hf(hf, warm, 4)
    ours, theirs = [], []
    equal = total = 0
    for repeat in range(args.repeats):
        prompts = make_prompts(args.prompts, args.prompt_len, seed=10 + repeat)
        ours_s, ours_tokens = run_kvrecover(llm, prompts, args.new_tokens)
        hf_s, hf_tokens = run_hf(hf, prompts, args.new_tokens)
        ours.append(ours_s)
        theirs.append(hf_s)
        equal += sum(a == b for a, b in zip(ours_tokens, hf_tokens))
        total += len(prompts)
    ours_s, hf_s = min(ours), min(theirs)
    new = args.prompts * args.new_tokens
    target_ratio = VLLM_SECONDS / VLLM_HF_SECONDS

    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"workload: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new "
          f"greedy tokens each, float32, best of {args.repeats} (all: kvrecover "
          f"{', '.join(f'{t:.2f}' for t in ours)} s; HF {', '.join(f'{t:.2f}' for t in theirs)} s)")
    print(f"greedy outputs equal to HF's: {equal}/{total} requests\n")
    rows = [
        ("| metric | kvrecover | HF transformers | kvrecover / HF | target |"),
        ("| --- | --- | --- | --- | --- |"),
        (f"| generate time (s) | {ours_s:.2f} | {hf_s:.2f} | {ours_s / hf_s:.2f}x | "
         f"<= {VLLM_SECONDS} s, i.e. <= {target_ratio:.2f}x HF (vLLM CPU: {VLLM_SECONDS} s "
         f"vs HF {VLLM_HF_SECONDS} s) |"),
        (f"| output tokens/s | {new / ours_s:.1f} | {new / hf_s:.1f} | "
         f"{hf_s / ours_s:.2f}x as fast | |"),
        (f"| start-up: import to LLM ready, best of 3 (s) | {startup['startup_s']:.2f} | | | "
         f"< {STARTUP_TARGET_S} s (process wall incl. interpreter: {startup_wall:.2f} s) |"),
        (f"| - of which import torch / import kvrecover / LLM() (s) | "
         f"{startup['import_torch_s']:.2f} / {startup['import_kvrecover_s']:.2f} / "
         f"{startup['llm_init_s']:.2f} | | | |"),
        (f"| peak memory, ru_maxrss (MB) | {memory['peak_rss_mb']:.0f} | | | "
         f"< {MEMORY_TARGET_MB:.0f} MB (after load: {memory['after_load_rss_mb']:.0f} MB) |"),
    ]
    print("\n".join(rows))
    verdicts = {
        "generate vs vLLM target (normalised by HF)": ours_s / hf_s <= target_ratio,
        "generate vs vLLM absolute 2.3 s": ours_s <= VLLM_SECONDS,
        "start-up": startup["startup_s"] < STARTUP_TARGET_S,
        "peak memory": memory["peak_rss_mb"] < MEMORY_TARGET_MB,
    }
    print("\n" + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in verdicts.items()))
    if args.profile:
        profile(llm, args.prompts, args.prompt_len, args.new_tokens)


if __name__ == "__main__":
    main()
