"""Logprobs in OpenAI's shapes: completions' `logprobs` object, chat's `logprobs.content`,
and vLLM's `prompt_logprobs`.

The server formats each streamed piece's logprobs here (`LogprobsFormatter`, which
carries the completions' `text_offset` across pieces); the writer joins pieces'
objects for a whole answer (`join_logprobs`). A token is named by its text decoded
alone (special tokens included); chat adds its UTF-8 `bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrecover.outputs import TokenLogprob

TokenTexts = Callable[[list[int]], list[str]]
MAX_COMPLETION_LOGPROBS = 20  # OpenAI allows 5; kvrecover (as vLLM) up to SamplingParams'


@dataclass
class LogprobsFormatter:
    """Formats one choice's logprobs, piece by piece, for completions or chat."""

    token_texts: TokenTexts
    chat: bool
    text_offset: int = 0  # completions: where the next token's text starts

    def piece(self, records: list[TokenLogprob | None],
              token_ids: list[int] | None = None) -> dict[str, Any]:
        """The `logprobs` object of one piece: `records` per token (None: the first
        prompt token, which has none; then `token_ids` names the tokens)."""
        ids = [r.token_id if r is not None else (token_ids or [])[i]
               for i, r in enumerate(records)]
        texts = self.token_texts(ids)
        if self.chat:
            return {"content": [self._chat_entry(r, text) for r, text in zip(records, texts)
                                if r is not None]}
        offsets = []
        for text in texts:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [None if r is None else r.logprob for r in records],
            "top_logprobs": [None if r is None else self._top_dict(r) for r in records],
            "text_offset": offsets,
        }

    def _top_dict(self, record: TokenLogprob) -> dict[str, float]:
        # OpenAI's completions shape keys the top tokens by text (and always holds the
        # chosen one); texts that collide keep the more likely entry.
        entries = [*record.top, (record.token_id, record.logprob)]
        texts = self.token_texts([t for t, _ in entries])
        top: dict[str, float] = {}
        for text, (_, logprob) in zip(texts, entries):
            top.setdefault(text, logprob)
        return top

    def _chat_entry(self, record: TokenLogprob, text: str) -> dict[str, Any]:
        top_texts = self.token_texts([t for t, _ in record.top])
        return {**_chat_token(text, record.logprob), "top_logprobs": [
            _chat_token(t, lp) for t, (_, lp) in zip(top_texts, record.top)]}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob,
            "bytes": list(text.encode("utf-8", "surrogatepass"))}


def prompt_logprobs_json(records: list[TokenLogprob | None],
                         token_texts: TokenTexts) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or
    {token id: {"logprob", "rank", "decoded_token"}} for the token and its top-k."""
    result: list[dict[str, Any] | None] = []
    for record in records:
        if record is None:
            result.append(None)
            continue
        entries = {record.token_id: (record.logprob, record.rank)}
        for rank, (token_id, logprob) in enumerate(record.top, start=1):
            entries.setdefault(token_id, (logprob, rank))
        texts = token_texts(list(entries))
        result.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": text}
                       for (t, (lp, rank)), text in zip(entries.items(), texts)})
    return result


def join_logprobs(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The `logprobs` object of a whole answer from its pieces' (lists joined)."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    joined: dict[str, list[Any]] = {key: [] for key in present[0]}
    for part in present:
        for key, values in part.items():
            joined.setdefault(key, []).extend(values or [])
    return joined
