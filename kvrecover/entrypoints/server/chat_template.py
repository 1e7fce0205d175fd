"""The checkpoint's chat template: messages -> prompt token ids.

Rendered by `transformers` (the template is Jinja code written for it), loaded
on the first chat request, since importing transformers takes seconds that a
completions-only server should not pay at start-up.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from kvrecover.entrypoints.openai.protocol import ApiError, checked_text


class ChatTemplate:
    """Renders chats with the template of the checkpoint in `model_dir`."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            return self._tokenizer

    def prompt_token_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of the chat with the assistant's turn opened (special tokens
        come from the template alone, as in vLLM)."""
        tokenizer = self._load()
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"the model at {self.model_dir} has no chat template; "
                                "use /v1/completions", param="messages")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
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
