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
from kvrecover.structured.schema import enforceable_schema
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
            if kind in ("json", "json_object"):
                schema = enforceable_schema(params.json) if kind == "json" else \
                    {"type": "object"}
                return compiler.compile_grammar(json_grammar(schema))
            if kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(params.choice or []))
            else:
                compiled = compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else \
                type(error).__name__
            # xgrammar prefixes its messages with "[time] path/file.cc:line: ".
            reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason \
                else reason
            raise ValueError(f"structured_outputs.{kind} does not compile: {reason}") from error
        if kind == "grammar" and not has_sentence(str(compiled.grammar)):
            raise ValueError(f"structured_outputs.{kind} does not compile: no finite string "
                             "matches it (its root rule never reaches an end)")
        return compiled


# xgrammar 0.2.9 writes a length-bounded JSON string's characters as [^"\\\r\n]: raw
# control characters (U+0000-U+001F but CR and LF) inside the string, JSON that does
# not parse. Both that class and the one of other strings also admit the UTF-8 bytes of
# a surrogate code point (ED A0-BF xx), text that decodes to three U+FFFD (a string of
# two characters as five). Both become characters that JSON writes raw, and only those.
STRING_CHARACTERS = {r'[^\"\\\r\n]': r'[^\0-\x1f\"\\\ud800-\udfff]',
                     r'[^\0-\x1f\"\\\r\n]': r'[^\0-\x1f\"\\\ud800-\udfff]'}


def json_grammar(schema: dict[str, Any]) -> str:
    """The EBNF of compact JSON that `schema` (from `enforceable_schema`) admits, with no
    raw control character or surrogate in any string."""
    grammar = str(load_xgrammar().Grammar.from_json_schema(
        schema, any_whitespace=False, strict_mode=True))
    for unsafe, safe in STRING_CHARACTERS.items():
        grammar = grammar.replace(unsafe, safe)
    return grammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes, which
    xgrammar's EBNF literals read the same way)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False)
                                    for choice in choices)


def has_sentence(grammar: str) -> bool:
    """Whether some finite string matches `grammar` (xgrammar's normalized EBNF, one
    `name ::= expression` a line): its root rule reaches an end (`root ::= root` or
    `root ::= "a" root` never does, so a request under it could only run to max_tokens).
    A line this reader does not follow counts as one that ends."""
    rules: dict[str, Any] = {}
    first = None
    for line in grammar.splitlines():
        if "::=" not in line:
            continue
        name, body = (part.strip() for part in line.split("::=", 1))
        try:
            rules[name] = _Expression(body).parse()
        except (IndexError, ValueError):
            return True
        first = first or name
    root = "root" if "root" in rules else first
    if root is None:
        return True
    ends: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, expression in rules.items():
            if name not in ends and _ends(expression, ends, rules):
                ends.add(name)
                changed = True
    return root in ends


def _ends(expression: Any, ends: set[str], rules: dict[str, Any]) -> bool:
    kind = expression[0]
    if kind == "end":
        return True
    if kind == "ref":
        return expression[1] in ends or expression[1] not in rules
    if kind == "alt":
        return any(_ends(e, ends, rules) for e in expression[1])
    if kind == "seq":
        return all(_ends(e, ends, rules) for e in expression[1])
    # ("repeat", least, inner)
    return expression[1] == 0 or _ends(expression[2], ends, rules)


class _Expression:
    """A recursive-descent reader of one normalized rule body: ("end",) for a terminal,
    ("ref", name), ("alt", [...]), ("seq", [...]), ("repeat", least, inner)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    def parse(self) -> Any:
        expression = self._alt()
        self._space()
        if self.at != len(self.text):
            raise ValueError(self.text[self.at:])
        return expression

    def _space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def _alt(self) -> Any:
        options = [self._seq()]
        self._space()
        while self.text[self.at:self.at + 1] == "|":
            self.at += 1
            options.append(self._seq())
            self._space()
        return options[0] if len(options) == 1 else ("alt", options)

    def _seq(self) -> Any:
        items = []
        while True:
            self._space()
            char = self.text[self.at:self.at + 1]
            if char in ("", "|", ")"):
                break
            if self.text.startswith("(=", self.at):  # a lookahead: no bearing on an end
                self.at += 2
                self._alt()
                self._close()
                continue
            items.append(self._quantified(self._atom()))
        return ("seq", items)

    def _close(self) -> None:
        self._space()
        if self.text[self.at] != ")":
            raise ValueError(self.text[self.at:])
        self.at += 1

    def _atom(self) -> Any:
        text, char = self.text, self.text[self.at]
        if char in "\"[":
            close = '"' if char == '"' else "]"
            self.at += 1
            while text[self.at] != close:
                self.at += 2 if text[self.at] == "\\" else 1
            self.at += 1
            return ("end",)
        if char == "(":
            self.at += 1
            inner = self._alt()
            self._close()
            return inner
        start = self.at
        while self.at < len(text) and (text[self.at].isalnum() or text[self.at] in "_-."):
            self.at += 1
        if self.at == start or text[self.at:self.at + 1] == "(":
            raise ValueError(text[start:])  # a macro such as Regex(...): not followed
        return ("ref", text[start:self.at])

    def _quantified(self, atom: Any) -> Any:
        char = self.text[self.at:self.at + 1]
        if char in ("*", "?"):
            self.at += 1
            return ("repeat", 0, atom)
        if char == "+":
            self.at += 1
            return ("repeat", 1, atom)
        if char == "{":
            close = self.text.index("}", self.at)
            least = int(self.text[self.at + 1:close].split(",")[0])
            self.at = close + 1
            return ("repeat", least, atom)
        return atom
