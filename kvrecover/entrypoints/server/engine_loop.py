"""The engine thread: continuous batching across HTTP requests.

The engine is not thread-safe, so exactly one thread owns it. HTTP handlers talk
to that thread through a command queue (add, abort, snapshot); the thread adds
and aborts requests between steps and hands each step's outputs back to the
asyncio loop in one batch. An idle thread woken by a request gathers the rest of a
burst of arrivals (a few ms) before stepping, so they share one prefill step. An
engine whose only work is blocks held for a connector's sends (a P2P producer's kept
prompts, until pulled or their lease ends) keeps stepping, SENDS_WAIT_S apart, so a
producer serves pulls and releases while no request runs. A request the engine rejects (a prompt too long, a bad token id, a lone surrogate)
comes back as a finished output with `error_type` "invalid_request_error", one whose
adding raises anything else as "internal_error", and the loop goes on; a step that
raises ends the loop (`alive` turns False) and fails every open request with
"internal_error". When the loop ends (`stop()` or a failed step) the thread
closes its LLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrecover.engine import EngineSnapshot
from kvrecover.outputs import CompletionOutput, RequestOutput, choice_request_id
from kvrecover.sampling import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the idle thread blocks on the command queue per turn
# An idle engine woken by a request waits this long for the next one of a burst (at
# most BURST_MAX_S in all) so that clients arriving together are prefilled in one
# step, instead of the first alone while the others queue behind it.
BURST_GAP_S = 0.003
BURST_MAX_S = 0.02
# An engine whose only work is blocks held for a connector's sends (a P2P producer's
# kept prompts) steps this often for their reports, and waits for commands between.
SENDS_WAIT_S = 0.005


@dataclass
class _Add:
    request_id: str
    prompt: str | dict
    params: SamplingParams
    streams: list[OutputStream]  # one per choice (`params.n`)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Snapshot:
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class OutputStream:
    """The outputs of one request, readable from the asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()

    async def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output; None when `wake()` was called, or when none came within
        `timeout` seconds (None: wait as long as it takes)."""
        if timeout is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def wake(self) -> None:
        """Make the reader's pending (or next) `get` return None; on the asyncio loop."""
        self.queue.put_nowait(None)


def error_output(request_id: str, message: str, error_type: str) -> RequestOutput:
    """A finished output that carries only an error."""
    return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "error")],
                         finished=True, error=message, error_type=error_type)


class EngineLoop:
    """Owns an `LLM` on a thread of its own; handlers call `add`, `abort`, `snapshot`."""

    def __init__(self, make_llm: Callable[[], Any]) -> None:
        self._make_llm = make_llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvrecover-engine", daemon=True)
        self.llm: Any = None  # read-only outside the thread: model_dir, max_model_len
        self.alive = False

    def start(self, timeout: float | None = None) -> None:
        """Build the engine on its thread; raises what the build raised."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not start in time")
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to finish, close the LLM (on that thread) and wait for it."""
        self._stopping.set()
        self._thread.join(timeout)

    # ----- called from the asyncio loop ----------------------------------------
    def add(self, request_id: str, prompt: str | dict, params: SamplingParams) -> OutputStream:
        """Queue a request of one choice; its outputs arrive on the returned stream."""
        return self.add_choices(request_id, prompt, params)[0]

    def add_choices(self, request_id: str, prompt: str | dict,
                    params: SamplingParams) -> list[OutputStream]:
        """Queue a request of `params.n` choices: choice i's outputs arrive on stream i
        (under `choice_request_id(request_id, i, n)`, the id `abort` takes for it)."""
        loop = asyncio.get_running_loop()
        streams = [OutputStream(loop) for _ in range(params.n)]
        if not self.alive:
            for index, stream in enumerate(streams):
                stream.queue.put_nowait(error_output(
                    choice_request_id(request_id, index, params.n),
                    "the engine loop is not running", "internal_error"))
            return streams
        self._commands.put(_Add(request_id, prompt, params, streams))
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (no more outputs arrive for it)."""
        self._commands.put(_Abort(request_id))

    async def snapshot(self, timeout: float = 5.0) -> EngineSnapshot:
        """`LLM.snapshot()`, taken by the engine thread between steps (all zeros and no
        counters once the loop is not running)."""
        if not self.alive:
            return EngineSnapshot({}, 0, 0, 0.0)
        command = _Snapshot()
        self._commands.put(command)
        return await asyncio.wait_for(asyncio.wrap_future(command.future), timeout)

    # ----- the engine thread ---------------------------------------------------
    def _run(self) -> None:
        try:
            self.llm = self._make_llm()
        except BaseException as error:  # handed to start(), which re-raises it
            self._startup_error = error
            self._ready.set()
            return
        self.alive = True
        self._ready.set()
        engine = self.llm.engine
        try:
            while not self._stopping.is_set():
                # Only blocks held for a connector's sends (a P2P producer's kept
                # prompts, until pulled or their lease ends): step for their reports,
                # a short wait apart, instead of spinning on empty steps.
                unfinished = engine.has_unfinished()
                if unfinished and engine.awaits_only_sends():
                    self._drain_commands(block=True, timeout=SENDS_WAIT_S)
                else:
                    self._drain_commands(block=not unfinished)
                if engine.has_unfinished():
                    self._deliver(engine.step())
                failure = engine.check_health()  # a tensor-parallel rank may have died
                if failure is not None:
                    raise RuntimeError(failure)
        except Exception as error:
            logger.exception("the engine loop failed")
            self.alive = False
            self._fail_all(f"the engine failed: {error}")
        self.alive = False
        self._fail_all("the server is shutting down")
        try:  # the owning thread closes it: cancels in-flight loads, shuts the connector
            self.llm.close()
        except Exception:
            logger.exception("closing the engine failed")

    def _drain_commands(self, block: bool, timeout: float = IDLE_WAIT_S) -> None:
        burst_end = None
        while True:
            try:
                if block:
                    command = self._commands.get(timeout=timeout)
                elif burst_end is not None:
                    command = self._commands.get(
                        timeout=max(0.0, min(BURST_GAP_S, burst_end - time.monotonic())))
                else:
                    command = self._commands.get_nowait()
            except queue.Empty:
                return
            if block and isinstance(command, _Add):
                burst_end = time.monotonic() + BURST_MAX_S
            block = False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                if self._streams.pop(command.request_id, None) is not None:
                    self.llm.engine.abort_request(command.request_id)
            else:
                command.future.set_result(self.llm.snapshot())

    def _add(self, command: _Add) -> None:
        """Queue one request; whatever adding it raises ends that request alone: a
        ValueError (bad input) as an invalid_request_error, anything else (a bug in
        tokenizing or checking it) as an internal_error, with any part of it already
        queued withdrawn. Only a failing step ends the loop."""
        n = len(command.streams)
        ids = [choice_request_id(command.request_id, i, n) for i in range(n)]
        try:
            self.llm.engine.add_request(command.request_id, command.prompt, command.params)
        except Exception as error:
            if isinstance(error, ValueError):
                message, error_type = str(error), "invalid_request_error"
            else:
                logger.exception("adding request %s failed", command.request_id)
                if not any(i in self._streams for i in ids):  # not another request's id
                    self.llm.engine.abort_request(command.request_id)
                message = f"the request could not be added: {type(error).__name__}: {error}"
                error_type = "internal_error"
            for choice_id, stream in zip(ids, command.streams):
                output = error_output(choice_id, message, error_type)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
            return
        self._streams.update(zip(ids, command.streams))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            batches.setdefault(stream.loop, []).append((stream, output))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, message: str) -> None:
        items = [(stream, error_output(rid, message, "internal_error"))
                 for rid, stream in self._streams.items()]
        self._streams.clear()
        for stream, output in items:
            try:
                stream.loop.call_soon_threadsafe(_put_all, [(stream, output)])
            except RuntimeError:  # that event loop is already closed
                pass


def _put_all(items: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.queue.put_nowait(output)
