"""The checkpoint's chat template: messages (and tools) -> prompt token ids.

Rendered by `transformers` (the template is Jinja code written for it), loaded
on the first chat request, since importing transformers takes seconds that a
completions-only server should not pay at start-up. The template also decides how
tool calls are parsed (`tool_parser`, see `openai/tool_parsers.choose_parser`).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from kvrecover.entrypoints.openai.protocol import ApiError, checked_text
from kvrecover.entrypoints.openai.tool_parsers import PARSERS, choose_parser

AUTO_PARSER = "auto"


class ChatTemplate:
    """Renders chats with the template of the checkpoint in `model_dir`; `tool_call_parser`
    is "auto" (from the template and the model family) or one of `PARSERS`."""

    def __init__(self, model_dir: Path, tool_call_parser: str = AUTO_PARSER) -> None:
        if tool_call_parser != AUTO_PARSER and tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be {AUTO_PARSER!r} or one of "
                             f"{', '.join(PARSERS)}, got {tool_call_parser!r}")
        self.model_dir = Path(model_dir)
        self.tool_call_parser = tool_call_parser
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def tool_parser(self) -> str | None:
        """The tool-call parser of `auto` tool calls (None: this checkpoint has none, the
        output stays content); loads the template the first time."""
        if self.tool_call_parser != AUTO_PARSER:
            return self.tool_call_parser
        template = getattr(self._load(), "chat_template", None)
        config_path = self.model_dir / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return choose_parser(template if isinstance(template, str) else None,
                             config.get("model_type"))

    def _load(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            return self._tokenizer

    def prompt_token_ids(self, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids of the chat with the assistant's turn opened (special tokens
        come from the template alone, as in vLLM); `tools` go to the template as
        `apply_chat_template(tools=...)`."""
        tokenizer = self._load()
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"the model at {self.model_dir} has no chat template; "
                                "use /v1/completions", param="messages")
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as error:  # the template itself rejected the chat
            raise ApiError(400, f"the chat template rejected the messages: {error}",
                           param="messages") from error
        if not isinstance(text, str):
            raise ApiError(500, f"the chat template of {self.model_dir} rendered "
                                f"{type(text).__name__}, not text", "internal_error")
        # The messages were checked, but a template can add characters of its own.
        checked_text(text, "messages")
        return tokenizer.encode(text, add_special_tokens=False)
