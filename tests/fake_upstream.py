"""Fake instances for the proxy tests, on 127.0.0.1: raw HTTP servers whose answers a
test scripts byte for byte (so they can send any event, cut a line, close early),
a faithful stand-in for `kvrecover serve`, and the proxy itself in this process.

`FaithfulModel` answers like `kvrecover serve` does (the same chunk shapes, one
token per chunk, `return_token_ids`, continuations of `prompt + generated`): its
next token depends only on the sequence so far, so a continuation on it yields
token for token what an undisturbed run would.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from serving_utils import free_port

from kvrecover.entrypoints.proxy.app import build_proxy_app
from kvrecover.entrypoints.proxy.config import ProxyConfig

VOCAB_SIZE = 1000
MAX_MODEL_LEN = 256
EOS_TOKEN_ID = 0


@dataclass
class Reply:
    """One raw HTTP answer: the body is sent as is and the connection closed."""

    status: int
    body: bytes
    content_type: str = "application/json"


Handler = Callable[[str, str, Any], Reply]  # (method, path, JSON body or None) -> Reply


def sse(events: list[str]) -> Reply:
    """A 200 event stream of `data: EVENT` lines (each event sent verbatim)."""
    return Reply(200, "".join(f"data: {event}\n\n" for event in events).encode(),
                 "text/event-stream")


class FakeUpstream:
    """An HTTP server on 127.0.0.1 that answers every request with `handler`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[str, Any]] = []  # (path, body) of every POST
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._answer, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            headers = dict(line.split(":", 1) for line in head[1:] if ":" in line)
            headers = {name.strip().lower(): value.strip() for name, value in headers.items()}
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            body = json.loads(raw) if raw else None
            if method == "POST":
                self.requests.append((path, body))
            reply = self.handler(method, path, body)
            writer.write(f"HTTP/1.1 {reply.status} X\r\ncontent-type: {reply.content_type}\r\n"
                         f"connection: close\r\n\r\n".encode() + reply.body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def health_reply(method: str, path: str) -> Reply | None:
    """What every fake answers on GET: /health with kvrecover's limits, /v1/models."""
    if path == "/health":
        return Reply(200, json.dumps({"status": "ok", "vocab_size": VOCAB_SIZE,
                                      "max_model_len": MAX_MODEL_LEN}).encode())
    if path == "/v1/models":
        return Reply(200, json.dumps({"object": "list", "data": [
            {"id": "fake", "object": "model", "created": 0, "owned_by": "test"}]}).encode())
    return None


class FaithfulModel:
    """Answers completions and chat like `kvrecover serve`, with a made-up model."""

    def prompt_ids(self, path: str, body: dict) -> list[int]:
        if path.endswith("chat/completions"):
            text = "\n".join(f"{m['role']}: {m['content']}" for m in body["messages"])
        else:
            text = body["prompt"]
        if isinstance(text, list):
            return list(text)
        return [1 + ord(char) % (VOCAB_SIZE - 1) for char in text]

    @staticmethod
    def next_token(sequence: list[int]) -> int:
        return 1 + (sequence[-1] * 31 + len(sequence) * 7 + 11) % (VOCAB_SIZE - 1)

    @staticmethod
    def token_text(token_id: int) -> str:
        return chr(ord("a") + token_id % 26)

    def generate(self, path: str, body: dict) -> tuple[list[int], list[int], str]:
        """Prompt ids, output ids and finish reason of one request."""
        prompt = self.prompt_ids(path, body)
        chat = path.endswith("chat/completions")
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is None:
            limit = MAX_MODEL_LEN - len(prompt) if chat else 16
        stop_ids = set(body.get("stop_token_ids") or [])
        output: list[int] = []
        while True:
            token = self.next_token(prompt + output)
            output.append(token)
            if token in stop_ids or (token == EOS_TOKEN_ID and not body.get("ignore_eos")):
                return prompt, output, "stop"
            if len(output) >= limit or len(prompt) + len(output) >= MAX_MODEL_LEN:
                return prompt, output, "length"

    def chunks(self, path: str, body: dict) -> list[dict]:
        """The stream's chunks, one token each, as the server writes them."""
        prompt, output, finish = self.generate(path, body)
        chat = path.endswith("chat/completions")
        chunks = []
        for position, token in enumerate(output):
            text = self.token_text(token)
            last = position == len(output) - 1
            choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                      "finish_reason": finish if last else None,
                                      "token_ids": [token]}
            chunk: dict[str, Any] = {"id": "cmpl-fake", "created": 1, "model": "fake",
                                     "object": "chat.completion.chunk" if chat
                                     else "text_completion", "choices": [choice]}
            if chat:
                choice["delta"] = {"role": "assistant", "content": text} if position == 0 \
                    else {"content": text}
                if position == 0:
                    chunk["prompt_token_ids"] = prompt
            else:
                choice["text"] = text
                if position == 0:
                    choice["prompt_token_ids"] = prompt
            chunks.append(chunk)
        return chunks

    def whole(self, path: str, body: dict) -> dict:
        """The non-streamed answer, as the server writes it."""
        prompt, output, finish = self.generate(path, body)
        text = "".join(self.token_text(t) for t in output)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(output),
                 "total_tokens": len(prompt) + len(output)}
        if path.endswith("chat/completions"):
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish, "token_ids": output}
            return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1,
                    "model": "fake", "choices": [choice], "usage": usage,
                    "prompt_token_ids": prompt}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                  "token_ids": output, "prompt_token_ids": prompt}
        return {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "fake",
                "choices": [choice], "usage": usage}

    def __call__(self, method: str, path: str, body: Any) -> Reply:
        known = health_reply(method, path)
        if known is not None:
            return known
        if body.get("stream"):
            return sse([json.dumps(chunk) for chunk in self.chunks(path, body)] + ["[DONE]"])
        return Reply(200, json.dumps(self.whole(path, body)).encode())


class InProcessProxy:
    """`build_proxy_app` served by uvicorn on a thread of this process."""

    def __init__(self, prefill: list[str], decode: list[str], **settings: Any) -> None:
        # Health checks time out after the interval: 0.25 s leaves a loaded machine
        # room, while a migrated-from instance is soon back up for the next request.
        config = ProxyConfig(prefill, decode, **{"health_check_interval": 0.25, "timeout": 5.0,
                                                 **settings})
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(build_proxy_app(config), "127.0.0.1",
                                                     port, log_level="error"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the in-process proxy did not start")
            time.sleep(0.02)

    def wait_all_up(self) -> None:
        """Until the health checks have every instance up again."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = httpx.get(f"{self.url}/health", timeout=5).json()["instances"]
            if all(state == "up" for state in states.values()):
                return
            time.sleep(0.02)
        raise AssertionError(f"instances still down: {states}")

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(15)

