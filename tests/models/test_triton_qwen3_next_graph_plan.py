"""The graphed decode path of a hybrid, without CUDA: a tiny Qwen3-Next on the Triton
backend (Triton's interpreter) whose `DecodeGraphs` "replay" re-runs the captured
forward on the static step buffer it was captured with, so each step's recurrent
plan must come from that buffer (packed by the step's inputs) and padding requests
must leave every state alone. Tokens equal the eager engine's, with checkpoints
written by decode steps and a second pass resuming from them. Marked `gpu`; runs on
the CPU under `TRITON_INTERPRET=1` (slowly)."""

from __future__ import annotations

from conftest import CUDA, TRITON_TESTS
from test_qwen3_next_vs_hf import FAMILIES, build_hybrid

from kvrecover import LLM, SamplingParams
from kvrecover.kv_layout import blocks_needed

pytestmark = TRITON_TESTS
BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2, 7], [3 + i % 50 for i in range(14)], [11 + i % 40 for i in range(7)]]


class _Replay:
    """A captured step stand-in: `replay` runs the forward again on the same inputs and
    writes the outputs where the capture's lie, as a CUDA graph's replay would."""

    def __init__(self, forward, inputs, logits, greedy) -> None:
        self.forward, self.inputs, self.logits, self.greedy = forward, inputs, logits, greedy

    def replay(self) -> None:
        logits, greedy = self.forward(self.inputs)
        self.logits.copy_(logits)
        self.greedy.copy_(greedy)


def replaying_graphs(llm: LLM) -> list[int]:
    """Give the runner `DecodeGraphs` whose captures are `_Replay`s; returns the list of
    replayed batch sizes."""
    from kvrecover.worker.cuda_graphs import DecodeGraphs, _Graph

    runner = llm.engine.model_runner
    builder = runner.inputs.for_graphs()
    graphs = DecodeGraphs(runner._decode_step, builder,
                          blocks_needed(runner.max_model_len, runner.layout.block_size),
                          runner.device, len(runner.layout.kv_groups))
    replays: list[int] = []

    def capture(size: int) -> _Graph:
        buffer = graphs._step_buffer()
        layout = builder.pack([], pad_to=size)
        builder.upload(layout, buffer)
        inputs = builder.views(layout, buffer)
        assert inputs.recurrent is not None and len(inputs.recurrent) == size
        logits, greedy = runner._decode_step(inputs)
        replay = _Replay(runner._decode_step, inputs, logits.clone(), greedy.clone())
        graphs.graphs[size] = captured = _Graph(replay, replay.logits, replay.greedy)
        return captured

    run = graphs.run

    def counted(scheduled, *args, **kwargs):
        replays.append(len(scheduled))
        return run(scheduled, *args, **kwargs)

    graphs._capture = capture
    graphs.run = counted
    runner.graphs = graphs
    return replays


def token_ids(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


def test_a_replayed_static_plan_gives_the_eager_tokens(tmp_path):
    folder = build_hybrid(tmp_path / "qwen3_next", **FAMILIES["qwen3_next"])
    device = "cuda:0" if CUDA else "cpu"
    settings = dict(device=device, dtype="float32", block_size=BLOCK, attention_backend="triton",
                    max_num_batched_tokens=32, enforce_eager=True)
    eager = LLM(str(folder), **settings)
    expected = token_ids(eager, PROMPTS)
    extended = [p + o[:9] for p, o in zip(PROMPTS, expected)]  # past decode-made boundaries
    expected_extended = token_ids(LLM(str(folder), **settings, enable_prefix_caching=False),
                                  extended)
    eager.close()
    graphed = LLM(str(folder), **settings)
    replays = replaying_graphs(graphed)
    assert token_ids(graphed, PROMPTS) == expected
    assert len(replays) >= GREEDY.max_tokens - 2 and set(replays) >= {3}
    hits = graphed.stats["prefix_cache_hit_tokens"]
    assert token_ids(graphed, extended) == expected_extended
    assert graphed.stats["prefix_cache_hit_tokens"] - hits >= 3 * BLOCK
