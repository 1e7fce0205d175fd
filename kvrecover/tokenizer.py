"""Text <-> token ids for a checkpoint folder.

Uses the `tokenizers` library on `tokenizer.json` directly when it exists (it
loads in milliseconds, where importing `transformers` takes seconds); otherwise
falls back to `transformers.AutoTokenizer`. As in transformers 5, the special
tokens a prompt gets come from `tokenizer.json`'s post-processor alone: the
`add_bos_token` / `add_eos_token` of `tokenizer_config.json` are ignored when a
`tokenizer.json` exists (`AutoTokenizer` drops them too).

Text is checked before it is encoded (`check_text`): a lone surrogate (valid in a
Python str and in JSON's `\\ud800`, but not Unicode text: the `tokenizers` library
raises TypeError on it) and a NUL character are a ValueError naming the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer as FastTokenizer
    from transformers import PreTrainedTokenizerBase

# What no prompt, message or stop string may hold: a lone UTF-16 surrogate (it has no
# UTF-8 encoding) and NUL (never text; C-string code along the way truncates at it).
_BAD_CHARACTER = re.compile("[\ud800-\udfff\x00]")


def check_text(text: str, field: str) -> None:
    """A ValueError naming `field` (e.g. "prompt", "messages[0].content", "stop[1]")
    when `text` holds a lone surrogate or a NUL character; callers check every string
    that reaches the tokenizer or the detokenizer."""
    bad = _BAD_CHARACTER.search(text)
    if bad is None:
        return
    code = ord(bad.group())
    kind = "a NUL character" if code == 0 else "a lone surrogate"
    raise ValueError(f"{field}: {kind} (U+{code:04X}) at character {bad.start()} is not "
                     "valid text; send UTF-8 text without NUL characters")


class Tokenizer:
    """Encodes prompts and decodes generated token ids."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        tokenizer_json = model_dir / "tokenizer.json"
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        # Exactly one of the two is set: `tokenizers` on tokenizer.json, else transformers.
        self._fast: FastTokenizer | None = None
        self._hf: PreTrainedTokenizerBase | None = None
        if tokenizer_json.is_file():
            from tokenizers import Tokenizer as FastTokenizer

            self._fast = FastTokenizer.from_file(str(tokenizer_json))
        else:
            try:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(model_dir))
            except Exception as error:
                raise ValueError(f"could not load a tokenizer from {model_dir}: {error}") from error
        self.eos_token_id = self._special_id(config, "eos_token")

    def _special_id(self, config: dict, key: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token is None:
            return None
        if self._fast is not None:
            return self._fast.token_to_id(token)
        token_id = self._transformers().convert_tokens_to_ids(token)
        return token_id if isinstance(token_id, int) else None  # a list: for a list of tokens

    def encode(self, text: str, field: str = "text", add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, with the special tokens the checkpoint adds (unless
        not `add_special_tokens`); a ValueError naming `field` for text that
        `check_text` refuses."""
        check_text(text, field)
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        return self._transformers().encode(text, add_special_tokens=add_special_tokens)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded alone, special tokens included (what logprobs name)."""
        if self._fast is not None:
            return [self._fast.decode([t], skip_special_tokens=False) for t in token_ids]
        hf = self._transformers()
        return [str(hf.decode([t], skip_special_tokens=False)) for t in token_ids]

    def decode(self, token_ids: list[int]) -> str:
        """Text of generated tokens, special tokens skipped."""
        if self._fast is not None:
            return self._fast.decode(token_ids, skip_special_tokens=True)
        text = self._transformers().decode(token_ids, skip_special_tokens=True)
        if not isinstance(text, str):  # a list: only for a batch of id lists
            raise TypeError(f"decoding one list of token ids gave {type(text).__name__}")
        return text

    def _transformers(self) -> PreTrainedTokenizerBase:
        if self._hf is None:  # the constructor set `_fast` or raised
            raise RuntimeError("the tokenizer has no transformers backend")
        return self._hf
