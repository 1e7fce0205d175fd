"""The server's engine thread while its only work is blocks held for a connector's sends
(a P2P producer's kept prompts): it keeps stepping, so the producer serves pulls and
lets leases end while no request runs, but SENDS_WAIT_S apart, not in a spin; a request
that comes meanwhile is taken at once."""

from __future__ import annotations

import asyncio
import threading
import time

from kvrecover import SamplingParams
from kvrecover.entrypoints.server import engine_loop as engine_loop_module
from kvrecover.entrypoints.server.engine_loop import EngineLoop


class HoldingEngine:
    """An engine that holds sends (has_unfinished, awaits_only_sends) until `release`."""

    def __init__(self) -> None:
        self.steps = 0
        self.holding = True
        self.added: list[str] = []
        self.lock = threading.Lock()

    def has_unfinished(self) -> bool:
        return self.holding

    def awaits_only_sends(self) -> bool:
        return self.holding and not self.added

    def step(self) -> list:
        with self.lock:
            self.steps += 1
        return []

    def check_health(self) -> None:
        return None

    def add_request(self, request_id, prompt, params) -> None:
        self.added.append(request_id)


class HoldingLLM:
    def __init__(self) -> None:
        self.engine = HoldingEngine()

    def close(self) -> None:
        pass


def steps_in(engine: HoldingEngine, seconds: float) -> int:
    before = engine.steps
    time.sleep(seconds)
    return engine.steps - before


def test_held_sends_are_stepped_for_without_spinning():
    loop = EngineLoop(HoldingLLM)
    loop.start(timeout=10)
    try:
        engine = loop.llm.engine
        steps = steps_in(engine, 0.5)
        most = 0.5 / engine_loop_module.SENDS_WAIT_S
        assert 5 <= steps <= most * 1.2, f"{steps} steps in 0.5 s (at most {most:.0f})"

        async def add() -> float:
            started = time.monotonic()
            loop.add("r1", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1))
            while not engine.added:
                await asyncio.sleep(0.001)
            return time.monotonic() - started

        assert asyncio.run(add()) < 0.5  # taken at once, not after a wait
        engine.holding = False  # released: the idle loop blocks on its queue
        time.sleep(0.1)
        assert steps_in(engine, 0.3) == 0
    finally:
        loop.stop()
