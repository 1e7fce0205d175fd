"""Where async-loading requests spend their time to first token, per request.

A producer stores a batch of prompts' KV (SharedStorageConnector); a fresh consumer
loads them asynchronously. For each request it prints, in ms from the first step and
with the engine step it happened in: load started (thread), read finished (thread),
installed and reported finished (worker's `get_finished`), admissible (scheduler),
scheduled, first token. Then every step (what it scheduled) and the number of idle
sleeps. Instrumentation wraps methods of this process only; nothing is changed.

  PYTHONPATH=. python bench/async_timeline.py --batch 16 --prompt-tokens 200     # tiny model
  PYTHONPATH=. python bench/async_timeline.py --default-model --batch 4 --prompt-tokens 512
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.engine import engine as engine_module
from kvrecover.engine.kv_loads import KVLoads
from kvrecover.engine.scheduler import Scheduler
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector
from kvrecover.kv_transfer.stores.store_base import StoreConnectorBase


class Timeline:
    """Per-request events (ms, step), the steps and the idle sleeps of one batch."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.step = 0
        self.events: dict[str, dict[str, tuple[float, int]]] = defaultdict(dict)
        self.steps: list[tuple[float, int]] = []  # (ms, requests scheduled)
        self.sleeps = 0

    def mark(self, request_id: str, what: str) -> None:
        ms = (time.perf_counter() - self.start) * 1e3
        self.events[request_id].setdefault(what, (ms, self.step))


def instrument(current: list[Timeline]) -> None:
    """Wrap the methods that mark the events into `current[0]`."""
    def wrap(owner, name, before=None, after=None):
        original = getattr(owner, name, None)
        if original is None:  # (an older tree: that path does not exist there)
            return

        def wrapped(self, *args):
            if before:
                before(self, *args)
            result = original(self, *args)
            if after:
                after(self, result, *args)
            return result
        setattr(owner, name, wrapped)

    t = current
    wrap(StoreConnectorBase, "_start_async", lambda s, tr: t[0].mark(tr.request_id, "started"))
    wrap(SharedStorageConnector, "_read_async",
         after=lambda s, r, tr, c: t[0].mark(tr.request_id, "read"))
    wrap(SharedStorageConnector, "_install",
         after=lambda s, r, tr, b: t[0].mark(tr.request_id, "installed"))
    # A step's async loads read as one batch: started together, each read as its run ends
    # (`_with_state`), installed together (`_install_step`).
    wrap(StoreConnectorBase, "_start_async_batch",
         lambda s, trs: [t[0].mark(tr.request_id, "started") for tr in trs])
    wrap(StoreConnectorBase, "_with_state",
         after=lambda s, r, tr, b, c: t[0].mark(tr.request_id, "read"))
    wrap(SharedStorageConnector, "_install_step",
         after=lambda s, r, trs, res: [t[0].mark(tr.request_id, "installed") for tr in trs])
    wrap(StoreConnectorBase, "get_finished",
         after=lambda s, r, ids: [t[0].mark(i, "reported") for i in r[1] or ()])
    wrap(KVLoads, "finish_loads",
         after=lambda s, r, *a: [t[0].mark(q.request_id, "admissible") for q in r])

    def scheduled(s, output):
        t[0].steps.append(((time.perf_counter() - t[0].start) * 1e3, len(output.scheduled)))
        for item in output.scheduled:
            t[0].mark(item.request_id, "scheduled")
    wrap(Scheduler, "schedule", before=lambda s: setattr(t[0], "step", t[0].step + 1),
         after=scheduled)
    sleep = time.sleep

    class CountingTime:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds):
            t[0].sleeps += 1
            sleep(seconds)
    engine_module.time = CountingTime()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--default-model", action="store_true",
                        help="the built-in default model (else a tiny random Llama)")
    parser.add_argument("--model", help="a checkpoint folder (e.g. bench_gpu.py's 1B one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="kvrecover_timeline_"))
    try:
        vocab = 384  # token ids every model here accepts
        if args.model or args.default_model:
            model = args.model
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from conftest import build_tiny_model
            model = str(build_tiny_model(root / "model"))
        rng = random.Random(0)
        prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_tokens)]
                   for _ in range(args.batch)]

        def make(role: str, **extra) -> LLM:
            transfer = KVTransferConfig("SharedStorageConnector", role,
                                        {"shared_storage_path": str(root / "store"), **extra})
            return LLM(model, device=args.device, enable_prefix_caching=False,
                       kv_transfer_config=transfer)

        producer = make("kv_producer")
        producer.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=1))
        producer.close()
        current = [Timeline()]
        instrument(current)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for repeat in range(args.repeats):
            consumer = make("kv_consumer", async_load=True)
            consumer.generate([{"prompt_token_ids": [5] * 40}], params)  # warm-up, no load
            engine = consumer.engine
            for index, prompt in enumerate(prompts):
                engine.add_request(f"r{index}", prompt, params)
            current[0] = timeline = Timeline()
            while engine.has_unfinished():
                for output in engine.step():
                    timeline.mark(output.request_id, "first token")
            consumer.close()
            print(f"\nrepeat {repeat}:")
            for request_id, events in timeline.events.items():
                print(f"  {request_id:>4}", "  ".join(
                    f"{what} {ms:7.1f} (s{step})" for what, (ms, step) in events.items()))
            steps = "  ".join(f"s{i + 1} {ms:.1f}:{n}" for i, (ms, n) in enumerate(timeline.steps))
            print(f"  steps (ms:requests scheduled): {steps}")
            firsts = {events["first token"][1] for events in timeline.events.values()}
            ttft = max(events["first token"][0] for events in timeline.events.values())
            print(f"  TTFT {ttft:.1f} ms; {len(timeline.steps)} steps, {timeline.sleeps} idle "
                  f"sleeps; first tokens in {len(firsts)} step(s): {sorted(firsts)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
