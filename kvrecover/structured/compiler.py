"""Compiles structured-output specs with xgrammar for one checkpoint, with a cache.

xgrammar is optional (bootstrap installs it without its dependencies, see
`scripts/bootstrap.sh`); without it a request with a grammar is a ValueError that
says how to install it, and every other request runs as before.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from kvrecover.structured.params import StructuredOutputsParams
from kvrecover.structured.state import GrammarState

XGRAMMAR_MISSING = (
    "structured outputs need the xgrammar package, which is not installed; install it "
    "with: pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2"
)
MAX_CACHED_GRAMMARS = 256


def load_xgrammar() -> Any:
    """The xgrammar module; a ValueError naming the install command when it is absent."""
    try:
        import xgrammar
    except ImportError as error:
        raise ValueError(XGRAMMAR_MISSING) from error
    return xgrammar


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into matchers for the checkpoint in `model_dir`.

    Built by the engine on the first request with a grammar (loading the Hugging Face
    tokenizer takes a moment). The tokenizer's info is made for `vocab_size`, the
    width of the model's logits: ids past the tokenizer's own vocabulary (padding
    rows) are never allowed. `stop_token_ids` are the tokens that end a complete
    output. Compiled grammars are cached by `StructuredOutputsParams.cache_key`
    (least recently used dropped past `MAX_CACHED_GRAMMARS`). Thread-safe.
    """

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = load_xgrammar()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher at the start of `params`' grammar, its replayed tokens not yet
        accepted (`GrammarState.replay`)."""
        return GrammarState(load_xgrammar().GrammarMatcher(self.compile(params)))

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params` (cached); a ValueError naming the field and
        xgrammar's reason when it does not compile."""
        key = params.cache_key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        compiler = self._compiler
        try:
            if kind == "json":
                return compiler.compile_json_schema(params.json, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema({"type": "object"}, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice or []))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else \
                type(error).__name__
            # xgrammar prefixes its messages with "[time] path/file.cc:line: ".
            reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason \
                else reason
            raise ValueError(f"structured_outputs.{kind} does not compile: {reason}") from error


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes, which
    xgrammar's EBNF literals read the same way)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False)
                                    for choice in choices)
