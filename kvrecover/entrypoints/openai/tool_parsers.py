"""Tool calls in generated text: the model family's format -> OpenAI `tool_calls`.

Two formats, chosen per checkpoint (`choose_parser`, or `serve --tool-call-parser`):
- `hermes` (Qwen 2.5 / Qwen 3, Hermes): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text before the first call is the message's content;
- `llama3_json` (Llama 3.1 / 3.2): the whole output is one or more JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;`, optionally after `<|python_tag|>`.
Text that does not parse as calls stays content, as in vLLM. Each parser reads a whole
output (`parse`) and a stream (`ToolCallStream`: text deltas in, content and complete
calls out, holding back only what may still turn into a call).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(re.escape(HERMES_START) + r"(.*?)(?:" + re.escape(HERMES_END) + r"|$)",
                          re.DOTALL)


def new_call_id() -> str:
    """An id for one tool call (OpenAI's `call_...` form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI writes it in a message (or, with `index`, in a stream delta)."""
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def choose_parser(chat_template: str | None, model_type: str | None) -> str | None:
    """The parser of a checkpoint: from what its chat template writes (`<tool_call>`:
    hermes; `<|python_tag|>` or Llama's `"parameters"` JSON: llama3_json), else from
    the model family (qwen: hermes, llama: llama3_json); None when neither tells."""
    template = chat_template or ""
    if HERMES_START in template:
        return "hermes"
    if PYTHON_TAG in template or ("tools" in template and '"parameters"' in template):
        return "llama3_json"
    family = (model_type or "").lower()
    if family.startswith("qwen"):
        return "hermes"
    if family == "llama" and "tools" in template:
        return "llama3_json"
    return None


def _call_of(obj: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            text = arguments if isinstance(arguments, str) else \
                json.dumps(arguments, ensure_ascii=False)
            return ToolCall(obj["name"], text)
    return ToolCall(obj["name"], "{}")


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; content None when only calls were written."""
    if parser == "hermes":
        return _parse_hermes(text)
    return _parse_llama3(text)


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        try:
            call = _call_of(json.loads(match.group(1)), ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls = []
    position = 0
    while position < len(body):
        try:
            obj, position = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return text, []
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
    return None, calls


class ToolCallStream:
    """Parses a streamed output: `feed` each text delta, `finish` at the end; both return
    (content to send now, calls completed now). Content is held back only while it may
    be the start of a call (a partial `<tool_call>`; for llama3_json, an output that
    opens with `{` or `<|python_tag|>`, which is held to the end)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self._held = ""  # text not yet sent as content
        self._in_calls = False  # hermes: a call opened; llama3_json: the output is calls
        self._undecided = parser == "llama3_json"  # llama3_json: first characters not seen

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls that `text` (the next delta) completes."""
        self._held += text
        if self.parser == "llama3_json":
            return self._feed_llama3()
        return self._feed_hermes(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left when the output ended (an unfinished call that does not parse is
        sent as content)."""
        if self.parser == "llama3_json":
            held, self._held = self._held, ""
            if not held:
                return "", []
            content, calls = _parse_llama3(held)
            return (content or "", calls)
        return self._feed_hermes(final=True)

    def _feed_llama3(self) -> tuple[str, list[ToolCall]]:
        if self._undecided:
            stripped = self._held.lstrip()
            if not stripped:
                return "", []
            if stripped.startswith("{") or PYTHON_TAG.startswith(stripped[:len(PYTHON_TAG)]):
                self._in_calls = True
            self._undecided = False
        if self._in_calls:
            return "", []
        held, self._held = self._held, ""
        return held, []

    def _feed_hermes(self, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._held:
            if not self._in_calls:
                start = self._held.find(HERMES_START)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self._held, HERMES_START)
                    content.append(self._held[:len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    break
                content.append(self._held[:start])
                self._held = self._held[start:]
                self._in_calls = True
            end = self._held.find(HERMES_END)
            if end < 0:
                if final:
                    text, parsed = _parse_hermes(self._held)
                    calls += parsed
                    if not parsed:
                        content.append(text or "")
                    self._held = ""
                break
            text, parsed = _parse_hermes(self._held[:end + len(HERMES_END)])
            if parsed:
                calls += parsed
            else:
                content.append(text or "")
            self._held = self._held[end + len(HERMES_END):].lstrip("\n")
            self._in_calls = False
        return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
