"""Text <-> token ids for a checkpoint folder.

Uses the `tokenizers` library on `tokenizer.json` directly when it exists (it
loads in milliseconds, where importing `transformers` takes seconds), with the
BOS/EOS settings of `tokenizer_config.json`; otherwise falls back to
`transformers.AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    """Encodes prompts and decodes generated token ids."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        tokenizer_json = model_dir / "tokenizer.json"
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self._fast = None
        self._hf = None
        if tokenizer_json.is_file():
            from tokenizers import Tokenizer as FastTokenizer

            self._fast = FastTokenizer.from_file(str(tokenizer_json))
            self._add_bos = self._special_id(config, "bos_token") if config.get("add_bos_token") else None
            self._add_eos = self._special_id(config, "eos_token") if config.get("add_eos_token") else None
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
        return self._hf.convert_tokens_to_ids(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, with the special tokens the checkpoint adds."""
        if self._hf is not None:
            return self._hf.encode(text)
        ids = self._fast.encode(text, add_special_tokens=True).ids
        if self._add_bos is not None and (not ids or ids[0] != self._add_bos):
            ids = [self._add_bos, *ids]
        if self._add_eos is not None and (not ids or ids[-1] != self._add_eos):
            ids = [*ids, self._add_eos]
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of generated tokens, special tokens skipped."""
        if self._hf is not None:
            return self._hf.decode(token_ids, skip_special_tokens=True)
        return self._fast.decode(token_ids, skip_special_tokens=True)
