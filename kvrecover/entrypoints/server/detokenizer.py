"""Incremental text of a generating request, with `stop` strings.

Each update decodes only a short window of recent tokens (the prefix/read offset
scheme), so streaming costs O(new tokens), and text that ends inside a multi-byte
character (a trailing U+FFFD) is held back until the character is complete: no
chunk carries broken UTF-8. While `stop` strings are set, the last
`len(longest stop) - 1` characters are held back too, so no part of a stop
string is ever sent; with `include_stop` (vLLM's `include_stop_str_in_output`) the
text ends with the stop string that ended it.

`resume` continues the text of an earlier generation whose tokens now end the
prompt (a request migrated by the proxy): a character split across the two
servers comes out whole, and text the first server held back is sent.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
PREFIX_WINDOW = 5  # tokens decoded before the new ones, so word-start spaces survive


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None,
                 include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.include_stop = include_stop
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all stable text decoded so far (stop truncation applied)
        self.sent = 0  # characters of `text` already handed out
        self.token_ids: list[int] = []
        self.stopped = False  # a stop string was found; the request must end
        self._prefix_offset = 0
        self._read_offset = 0
        self._resumed: list[int] = []

    def resume(self, token_ids: list[int], sent_text: str) -> None:
        """Start after `token_ids` of earlier output, of which `sent_text` reached the
        client; call before the first `update`."""
        self._resumed = list(token_ids)
        self.token_ids = list(token_ids)
        stable = len(token_ids)
        while stable > 0 and self.tokenizer.decode(token_ids[:stable]).endswith(REPLACEMENT_CHAR):
            stable -= 1  # the tail is an incomplete character: decode it with what follows
        self.text = self.tokenizer.decode(token_ids[:stable])
        self.sent = len(sent_text) if self.text.startswith(sent_text) else len(self.text)
        self._read_offset = stable
        self._prefix_offset = max(0, stable - PREFIX_WINDOW)

    def update(self, token_ids: list[int], final_text: str | None = None) -> str:
        """Take the request's tokens so far; return the text that may be sent now.

        `final_text` is the engine's full text when the request finished; it
        replaces the incremental text so the total equals the engine's output.
        """
        if self.stopped:
            return ""
        if self._resumed:  # the engine's text lacks the resumed part: decode it all
            token_ids = self._resumed + list(token_ids)
            final_text = None if final_text is None else self.tokenizer.decode(token_ids)
        if len(token_ids) > len(self.token_ids):
            self.token_ids = list(token_ids)
        if final_text is not None:
            if final_text.startswith(self.text[:self.sent]):
                self.text = final_text
        else:
            self._decode_new()
        self._apply_stop()
        end = len(self.text) if (final_text is not None or self.stopped) else \
            max(self.sent, len(self.text) - self.hold_back)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def _decode_new(self) -> None:
        ids = self.token_ids
        prefix = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return  # nothing new, or a character still incomplete
        self.text += full[len(prefix):]
        self._prefix_offset = max(0, len(ids) - PREFIX_WINDOW)
        self._read_offset = len(ids)

    def _apply_stop(self) -> None:
        if not self.stop:
            return
        start = max(0, self.sent - self.hold_back)
        found = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop)
                 if i >= 0]
        if found:
            index, stop = min(found, key=lambda match: match[0])  # the first in the list on ties
            self.text = self.text[:index + (len(stop) if self.include_stop else 0)]
            self.stopped = True
