"""`tools` and `tool_choice` of a chat request: checked, rendered, enforced and answered.

- `ToolRequest.of(tools, tool_choice)` checks both (a tool that is not a function spec,
  a `tool_choice` naming an unknown function: a 400 naming the field);
- `template_tools` is what the chat template gets (`tools=` of `apply_chat_template`);
  with `tool_choice="none"` the tools are left out of the prompt;
- `grammar` enforces `required` (a JSON array of `{"name", "parameters"}` calls, at least
  one) and a named function (its `parameters` schema: the output is the arguments), as
  vLLM does, through structured outputs; `auto` leaves the model free and the family's
  parser (`tool_parsers`) finds the calls;
- `ToolAnswer` turns the output, whole or streamed, into `message.tool_calls` / `tool_calls`
  deltas and the `"tool_calls"` finish reason. The server and the proxy (which
  continues a migrated request as a completion) share this module.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvrecover.entrypoints.openai.protocol import ApiError
from kvrecover.entrypoints.openai.tool_parsers import ToolCall, ToolCallStream, parse_tool_calls
from kvrecover.structured.params import StructuredOutputsParams

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class FunctionTool:
    """One `{"type": "function", "function": {...}}` tool of a request."""

    name: str
    parameters: dict[str, Any]
    spec: dict[str, Any]  # the tool as the client sent it, for the chat template


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and how it may call them: `choice` is "none", "auto",
    "required" or the name of the one function it must call (`named`)."""

    tools: tuple[FunctionTool, ...]
    choice: str
    named: bool = False

    @classmethod
    def of(cls, tools: Any, tool_choice: Any) -> ToolRequest | None:
        """The request's tools, or None without any; a bad one is a 400."""
        if tools is None:
            if tool_choice not in (None, "none"):
                raise ApiError(400, "tool_choice needs tools", param="tool_choice")
            return None
        if not isinstance(tools, list):
            raise ApiError(400, "tools must be a list of function tools", param="tools")
        parsed = tuple(_function_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
        names = [tool.name for tool in parsed]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools must have distinct function names", param="tools")
        if not parsed:
            return None if tool_choice in (None, "none", "auto") else cls._no_tools()
        if tool_choice is None:
            return cls(parsed, "auto")
        if tool_choice in ("none", "auto", "required"):
            return cls(parsed, tool_choice)
        name = _named_choice(tool_choice)
        if name not in names:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not one of "
                                f"the tools ({', '.join(names)})", param="tool_choice")
        return cls(parsed, name, named=True)

    @staticmethod
    def _no_tools() -> ToolRequest:
        raise ApiError(400, "tool_choice requires a function, but tools is empty",
                       param="tool_choice")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template; None (left out) when none may be called."""
        return None if self.choice == "none" else [tool.spec for tool in self.tools]

    def grammar(self) -> StructuredOutputsParams | None:
        """What the output must follow: the named function's arguments, or for
        `required` an array of calls; None for `auto` and `none`."""
        if self.named:
            tool = next(t for t in self.tools if t.name == self.choice)
            return StructuredOutputsParams(json=tool.parameters)
        if self.choice != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [tool.name]},
                                 "parameters": tool.parameters},
                  "required": ["name", "parameters"]} for tool in self.tools]
        return StructuredOutputsParams(
            json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})


def continuation_structured_outputs(body: dict[str, Any]) -> dict[str, Any] | None:
    """The `structured_outputs` that continue a chat request `body` (a raw JSON body, as
    the proxy has it) whose `tool_choice` forces a grammar; None when it forces none."""
    tools = ToolRequest.of(body.get("tools"), body.get("tool_choice"))
    grammar = None if tools is None else tools.grammar()
    return None if grammar is None else {"json": grammar.json}


def _function_tool(tool: Any, where: str) -> FunctionTool:
    if not isinstance(tool, dict) or tool.get("type") != "function" or \
            not isinstance(tool.get("function"), dict):
        raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{...}}}}",
                       param=where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise ApiError(400, f"{where}.function.name must be 1 to 64 letters, digits, '_' or "
                            f"'-', got {name!r:.80}", param=f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{where}.function.description must be a string",
                       param=f"{where}.function.description")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema object",
                       param=f"{where}.function.parameters")
    return FunctionTool(name, parameters, tool)


def _named_choice(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or \
            not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}, got "
                            f"{tool_choice!r:.80}", param="tool_choice")
    return function["name"]


@dataclass
class ToolAnswer:
    """Writes one chat answer's tool calls: from the whole text (`message`) or from its
    deltas (`delta`). `parser` finds the calls of an `auto` request (None: no parser
    for this checkpoint, the text stays content)."""

    request: ToolRequest
    parser: str | None
    called: bool = False  # a call was written: the finish reason is "tool_calls"
    _stream: ToolCallStream | None = None
    _arguments_started: bool = False
    _named_call: ToolCall | None = None
    _required_text: list[str] = field(default_factory=list)
    _count: int = 0

    def message(self, text: str) -> dict[str, Any]:
        """The `content` and `tool_calls` of a whole answer's message."""
        content, calls = self._parse_whole(text)
        self.called = bool(calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for an answer that called a tool and stopped normally."""
        return "tool_calls" if self.called and reason == "stop" else reason

    def _parse_whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        request = self.request
        if request.named:
            return None, [ToolCall(request.choice, text)]
        if request.choice == "required":
            return None, _required_calls(text)
        if request.choice == "auto" and self.parser is not None:
            return parse_tool_calls(self.parser, text)
        return text, []

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The `content` / `tool_calls` of the streamed delta for `text` (`final`: the
        answer's last delta, which flushes whatever was held back)."""
        request = self.request
        content = ""
        calls: list[dict[str, Any]] = []
        if request.named:
            if self._named_call is None:  # the name first, then argument fragments
                self._named_call = ToolCall(request.choice, "")
                calls.append({**self._named_call.openai(0)})
                calls[0]["function"]["arguments"] = text
            elif text:
                calls.append({"index": 0, "function": {"arguments": text}})
        elif request.choice == "required":
            self._required_text.append(text)
            if final:
                calls = [call.openai(i) for i, call in
                         enumerate(_required_calls("".join(self._required_text)))]
        elif request.choice == "auto" and self.parser is not None:
            if self._stream is None:
                self._stream = ToolCallStream(self.parser)
            content, parsed = self._stream.feed(text)
            if final:
                more_content, more = self._stream.finish()
                content, parsed = content + more_content, parsed + more
            for call in parsed:
                calls.append(call.openai(self._count))
                self._count += 1
        else:
            content = text
        self.called = self.called or bool(calls)
        delta: dict[str, Any] = {"content": content}
        if calls:
            delta["tool_calls"] = calls
        return delta


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a `required` answer (its grammar's JSON array); none if it was cut
    short (then the finish reason says "length")."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
            for call in calls if isinstance(call, dict) and "name" in call]
