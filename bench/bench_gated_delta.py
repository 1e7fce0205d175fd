"""The Triton gated delta rule alone (`ops/triton/gated_delta.py`): time per call and error
against the torch reference (float32, same inputs) for each launch config
(`MAX_VALUE_BLOCK` value dims per program x `NUM_WARPS`), on decode and prefill steps of
a Qwen3-Next layer's shape, in one run. Picks the config the module defaults to.

    PYTHONPATH=. python bench/bench_gated_delta.py [--configs 32x4 32x8 16x8]
        [--cases 1x1 16x1 64x1 1x1024 16x256] [--calls 20]
    PYTHONPATH=.:/work/triton_site TRITON_INTERPRET=1 python bench/bench_gated_delta.py \
        --tiny --calls 1      # proves the script on a CPU (Triton's interpreter)

A case RxN is R requests of N new rows each, every request at position 0 (a fresh
prompt) for prefill rows, or after two full chunks and five rows (so the step reads
and writes tails) for decode. Error: the largest absolute difference of the outputs and
final states from the reference's, started from the same zero pools.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from kvrecover.models.recurrent_state import RequestRows
from kvrecover.ops.interface import DeltaRuleState
from kvrecover.ops.reference.torch_ops import TorchOps

QWEN3_NEXT = (16, 32, 128, 128)  # key heads, value heads, key dim, value dim
TINY = (1, 2, 16, 64)
CHUNK = 16


@dataclass(frozen=True)
class Case:
    requests: int
    rows: int

    @classmethod
    def parse(cls, text: str) -> Case:
        requests, rows = text.split("x")
        return cls(int(requests), int(rows))

    @property
    def start(self) -> int:
        """Each request's first position: mid-chunk for decode-sized steps."""
        return 2 * CHUNK + 5 if self.rows < CHUNK else 0


def pools(shape: tuple[int, ...], slots: int, device: str) -> DeltaRuleState:
    _, hv, dk, dv = shape
    zeros = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
    return DeltaRuleState(zeros(slots, hv, dk, dv), zeros(slots, CHUNK, hv, dk),
                          zeros(slots, CHUNK, hv, dk), zeros(slots, CHUNK, hv, dv),
                          zeros(slots, CHUNK, hv), zeros(slots, CHUNK, hv))


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def inputs(shape: tuple[int, ...], case: Case, device: str) -> Inputs:
    """query, key, value, decay and beta rows of every request of the step."""
    hk, hv, dk, dv = shape
    total = case.requests * case.rows
    gen = torch.Generator().manual_seed(case.requests * 1000 + case.rows)
    tensors = [torch.randn(total, hk, dk, generator=gen), torch.randn(total, hk, dk, generator=gen),
               torch.randn(total, hv, dv, generator=gen),
               -torch.rand(total, hv, generator=gen) * 0.5, torch.rand(total, hv, generator=gen)]
    query, key, value, decay, beta = (t.to(device) for t in tensors)
    return query, key, value, decay, beta


def fill_history(states: DeltaRuleState, case: Case, seed: int) -> None:
    """Give every slot a state and tail rows, as a request that has seen `case.start` rows."""
    gen = torch.Generator().manual_seed(seed)
    tail = case.start % CHUNK
    parts = [states.state, states.query_tail[:, :tail], states.key_tail[:, :tail],
             states.value_tail[:, :tail]]
    for part in parts:
        part.copy_(torch.randn(part.shape, generator=gen) * 0.1)
    states.decay_tail[:, :tail].copy_(-torch.rand(states.decay_tail[:, :tail].shape, generator=gen))
    states.beta_tail[:, :tail].copy_(torch.rand(states.beta_tail[:, :tail].shape, generator=gen))


def requests_of(case: Case) -> list[RequestRows]:
    return [RequestRows(i * case.rows, (i + 1) * case.rows, case.start, i)
            for i in range(case.requests)]


def error_against_reference(shape, case: Case, device: str) -> float:
    tensors = inputs(shape, case, device)
    requests = requests_of(case)
    results = []
    for ops in (TorchOps(), triton_ops()):
        states = pools(shape, case.requests, device)
        fill_history(states, case, seed=1)
        out = ops.gated_delta_rule_batch(*tensors, states, requests, CHUNK)
        results.append((out, states.state))
    (ref_out, ref_state), (out, state) = results
    return max((out - ref_out).abs().max().item(), (state - ref_state).abs().max().item())


def time_per_call(shape, case: Case, device: str, calls: int) -> float:
    tensors = inputs(shape, case, device)
    requests = requests_of(case)
    states = pools(shape, case.requests, device)
    ops = triton_ops()
    ops.gated_delta_rule_batch(*tensors, states, requests, CHUNK)  # compile, build the plan
    if device != "cuda":
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        ops.gated_delta_rule_batch(*tensors, states, requests, CHUNK)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def triton_ops():
    from kvrecover.ops.triton.fused_ops import TritonOps

    return TritonOps()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["64x4", "32x4", "32x8", "16x8", "16x4"],
                        help="MAX_VALUE_BLOCK x NUM_WARPS")
    parser.add_argument("--cases", nargs="+", default=["1x1", "16x1", "64x1", "1x1024", "16x256"])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help=f"shape {TINY} (CPU check)")
    args = parser.parse_args()
    from kvrecover.ops.triton import gated_delta

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = TINY if args.tiny else QWEN3_NEXT
    cases = [Case.parse(c) for c in args.cases]
    default = (gated_delta.MAX_VALUE_BLOCK, gated_delta.NUM_WARPS)
    print(f"shape (key heads, value heads, key dim, value dim) {shape}, chunk {CHUNK}, "
          f"module default {default[0]}x{default[1]}, device {device}")
    print("| config | " + " | ".join(f"{c.requests}x{c.rows} us (err)" for c in cases) + " |")
    print("| --- |" + " ---: |" * len(cases))
    for config in args.configs:
        block, warps = (int(x) for x in config.split("x"))
        gated_delta.MAX_VALUE_BLOCK, gated_delta.NUM_WARPS = block, warps
        cells = []
        for case in cases:
            micros = time_per_call(shape, case, device, args.calls)
            error = error_against_reference(shape, case, device)
            cells.append(f"{micros:,.1f} ({error:.1e})")
        print(f"| {config} | " + " | ".join(cells) + " |", flush=True)
    gated_delta.MAX_VALUE_BLOCK, gated_delta.NUM_WARPS = default


if __name__ == "__main__":
    main()
