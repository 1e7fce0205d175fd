"""`StructuredOutputsParams`: the one grammar a request's output must follow."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains a request's output to exactly one of (vLLM's names):

    - `json`: a JSON schema (a dict or its JSON text); the output is compact JSON
      (`", "` and `": "` separators, no other whitespace, so a model cannot pad forever);
    - `regex`: a regular expression the whole output matches;
    - `choice`: one of these strings, verbatim;
    - `grammar`: an EBNF grammar (xgrammar's GBNF dialect, `root ::= ...`);
    - `json_object=True`: any JSON value of type object.

    Generation stops when the grammar is complete (an EOS token is allowed only
    then) or at `max_tokens`. `replay_prompt_tokens` (kvrecover's own) says that the
    prompt's last N tokens were generated under this grammar already (a request the
    proxy migrated): the matcher accepts them before the first token is sampled.
    A spec of the wrong shape is a ValueError here; one that does not compile is a
    ValueError when the engine adds the request.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    replay_prompt_tokens: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        _check_types(self)
        if isinstance(self.choice, list):  # frozen: keep a private copy of the caller's list
            object.__setattr__(self, "choice", list(self.choice))
        if isinstance(self.replay_prompt_tokens, bool) or not isinstance(
                self.replay_prompt_tokens, int) or self.replay_prompt_tokens < 0:
            raise ValueError("structured_outputs.replay_prompt_tokens must be an integer "
                             f">= 0, got {self.replay_prompt_tokens!r}")

    @property
    def kind(self) -> str:
        """Which of `KINDS` is set."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """(kind, canonical spec text): equal for specs that compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            schema = self.json if isinstance(self.json, str) else \
                json.dumps(self.json, sort_keys=True, separators=(",", ":"))
            return kind, schema
        if kind == "choice":
            return kind, json.dumps(self.choice, ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))


def _check_types(params: StructuredOutputsParams) -> None:
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json":
        if not isinstance(value, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its "
                             f"JSON text), got {type(value).__name__}")
    elif kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(
                isinstance(c, str) and c for c in value):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {value!r:.80}")
    elif kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
    elif not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string, "
                         f"got {value!r:.80}")
