"""Where a CPU generate's time goes: engine phases (wall) and torch ops by category.

Command (repository root, default model converted):

    .venv/bin/python bench/profile_cpu.py --shapes 8x256x64 32x256x64 8x1024x32

Per shape (batch x prompt x new tokens, float32 or `--dtype`, greedy, fresh random prompts after
a warm-up on other prompts) it prints the wall time of each engine phase (schedule,
step inputs, forward, LM head + sampling, update) split into prefill steps and decode
steps, and the torch profiler's self time grouped into linears, attention, KV
gather, KV store, sampling, small ops and the rest; "python" is the forward's wall
time that no torch op accounts for.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

CATEGORIES = {
    "linears": ("_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm", "aten::matmul"),
    "attention": ("scaled_dot_product", "aten::_softmax", "aten::bmm", "aten::baddbmm",
                  "kvrecover::", "paged_attention"),
    "kv store": ("aten::index_copy", "aten::index_put", "aten::copy_"),
    "kv gather": ("aten::index_select", "aten::index_fill", "aten::index", "aten::take"),
    "sampling": ("aten::argmax", "aten::topk", "aten::sort", "aten::multinomial"),
    "small ops": ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt",
                  "aten::silu", "aten::roll", "aten::embedding", "aten::cat", "aten::to",
                  "aten::_to_copy", "aten::chunk", "aten::split", "aten::pad",
                  "aten::constant_pad_nd", "aten::sub", "aten::neg", "aten::where"),
}


def category(op_name: str) -> str:
    for name, keys in CATEGORIES.items():
        if any(key in op_name for key in keys):
            return name
    return "other ops"


class PhaseTimer:
    """Wraps engine methods to add up their wall time, split by prefill / decode step."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self.kind = "decode"

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[(self.kind, name)] += time.perf_counter() - start

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attr, wrapped)


def run_shape(llm, batch: int, prompt_len: int, new_tokens: int, with_profiler: bool) -> None:
    import torch

    from kvrecover import SamplingParams

    engine = llm.engine
    runner = engine.model_runner
    timer = PhaseTimer()
    start_schedule = time.perf_counter()
    original_schedule = engine.scheduler.schedule

    def schedule():
        nonlocal start_schedule
        start_schedule = time.perf_counter()
        out = original_schedule()
        prefill = any(len(s.token_ids) > 1 for s in out.scheduled)
        timer.kind = "prefill" if prefill else "decode"
        timer.steps[timer.kind] += 1
        timer.seconds[(timer.kind, "schedule")] += time.perf_counter() - start_schedule
        return out

    engine.scheduler.schedule = schedule
    timer.wrap(runner, "_step_inputs", "step inputs")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "logits", "lm head")
    timer.wrap(runner, "_sample", "sampling")
    timer.wrap(engine.scheduler, "update_from_output", "update")

    generator = torch.Generator().manual_seed(batch * 7919 + prompt_len)
    prompts = torch.randint(100, 49152, (batch, prompt_len), generator=generator).tolist()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    profiler = None
    if with_profiler:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    start = time.perf_counter()
    llm.generate(requests, params)
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.__exit__(None, None, None)
    for attr in ("_step_inputs", "_sample"):
        delattr(runner, attr)
    for obj, attr in ((runner.model, "forward"), (runner.model, "logits"),
                      (engine.scheduler, "schedule"), (engine.scheduler, "update_from_output")):
        delattr(obj, attr)

    print(f"\n=== {batch} x {prompt_len} x {new_tokens}: generate {wall:.2f} s "
          f"({timer.steps['prefill']} prefill steps, {timer.steps['decode']} decode steps)"
          f"{' under the profiler' if with_profiler else ''}")
    print("| phase | prefill s | decode s | decode ms/step |")
    print("|---|---:|---:|---:|")
    names = ("schedule", "step inputs", "forward", "lm head", "sampling", "update")
    accounted = 0.0
    for name in names:
        p, d = timer.seconds[("prefill", name)], timer.seconds[("decode", name)]
        accounted += p + d
        per = 1000 * d / max(1, timer.steps["decode"])
        print(f"| {name} | {p:.3f} | {d:.3f} | {per:.2f} |")
    print(f"| engine rest | {wall - accounted:.3f} (both) | | |")
    if profiler is None:
        return
    totals: dict[str, float] = defaultdict(float)
    top: list[tuple[float, str]] = []
    for event in profiler.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        totals[category(event.key)] += seconds
        top.append((seconds, event.key))
    forward = sum(timer.seconds[(k, "forward")] + timer.seconds[(k, "lm head")]
                  for k in ("prefill", "decode"))
    print("| torch self time | s | share of generate |")
    print("|---|---:|---:|")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {seconds:.3f} | {100 * seconds / wall:.1f}% |")
    print("top ops:", ", ".join(f"{k} {s:.2f}s" for s, k in sorted(top, reverse=True)[:12]))
    print(f"(forward + lm head wall {forward:.2f} s; ops total {sum(totals.values()):.2f} s)")


def _label_attention(attention) -> None:
    """Make the attention call visible to the profiler: a C kernel has no torch op."""
    import torch

    forward = attention.forward

    def labelled(*args, **kwargs):
        with torch.profiler.record_function("kvrecover::paged_attention"):
            return forward(*args, **kwargs)

    attention.forward = labelled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["8x256x64", "32x256x64", "8x1024x32"])
    parser.add_argument("--no-profiler", action="store_true", help="phase wall times only")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    args = parser.parse_args()
    import torch

    from kvrecover import LLM, SamplingParams

    llm = LLM(None, device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    backend = llm.engine.model_runner.backend
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"kernels {backend.name} / attention {backend.attention.name}")
    _label_attention(backend.attention)
    warm = torch.randint(100, 49152, (4, 300), generator=torch.Generator().manual_seed(1))
    llm.generate([{"prompt_token_ids": p} for p in warm.tolist()],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for shape in args.shapes:
        batch, prompt_len, new_tokens = (int(x) for x in shape.split("x"))
        run_shape(llm, batch, prompt_len, new_tokens, not args.no_profiler)


if __name__ == "__main__":
    main()
