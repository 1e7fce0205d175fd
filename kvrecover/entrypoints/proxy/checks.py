"""What the proxy accepts from an instance: the shape of each answer, and content
that is possible for the request.

Every upstream event becomes a `Piece` only through `piece_from_event` (the
OpenAI chunk shape, one choice, index 0, the token ids the proxy asked for), and
every piece then passes a `StreamCheck`, which rejects what no engine could have
produced for this request, using what the proxy knows: `max_tokens`,
`ignore_eos`, the stop strings and stop token ids of the request, the instance's
vocabulary size and `max_model_len` (from its `/health`), the prompt and the
tokens already sent. Rejected is only the provably impossible:
- a token id outside [0, vocab_size), or a prompt other than the one expected;
- more tokens than `max_tokens`, or than `max_model_len` leaves room for;
- `finish_reason: "length"` before either limit is reached, or before
  `max_tokens` on an instance that did not say its `max_model_len` (nothing
  then shows the context was reached);
- `finish_reason: "stop"` that no stop condition explains: under `ignore_eos`
  with no stop string and no stop token id as the last token, or before
  `min_tokens` with no stop string (which bans EOS and stop token ids until
  then). EOS, a stop string or a stop token id may end any other request early,
  and a grammar (`response_format`, `structured_outputs`, `guided_*`, `tools`) may end one
  when complete, so neither rule applies to a grammar's request;
- a stop token id that did not end the request;
- a finish reason the engine never gives (only "stop" and "length").
Either failure is a `ValueError` (`ShapeError` or `ImpossibleOutput`), which the
upstream reader turns into a failed instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvrecover.entrypoints.openai.shapes import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatStreamChoice,
    Completion,
    CompletionChoice,
    ShapeError,
    parse_shape,
)
from kvrecover.entrypoints.proxy.instances import Instance

# Without a vocabulary size from the instance: no engine stores token ids wider than int32.
MAX_TOKEN_ID_UNKNOWN_VOCAB = (1 << 31) - 1
ENGINE_FINISH_REASONS = ("stop", "length")
# Fields whose grammar may end a request early (vLLM's `guided_*` spell `structured_outputs`).
GRAMMAR_KEYS = ("response_format", "structured_outputs", "tools", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar")


Choice = TypeVar("Choice", ChatStreamChoice, CompletionChoice, ChatChoice)


class ImpossibleOutput(ValueError):
    """Content of the right shape that no engine could have produced for this request."""


@dataclass
class Piece:
    """What one upstream chunk added (to choice `index` of the client's answer)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunk
    model: str | None = None
    logprobs: dict[str, Any] | None = None  # the chunk's OpenAI logprobs object
    prompt_logprobs: list[Any] | None = None  # vLLM's, on the first chunk
    index: int = 0


def piece_from_event(event: Any, chat: bool) -> Piece:
    """One streamed chunk as a Piece; a ShapeError unless it is a chunk of the
    proxy's single-choice request with its token ids."""
    token_ids: list[int] | None
    if chat:
        chunk = parse_shape(ChatCompletionChunk, event)
        chat_choice = _only_choice(chunk.choices)
        text, token_ids, finish = (chat_choice.delta.content or "", chat_choice.token_ids,
                                   chat_choice.finish_reason)
        prompt_ids, model = chunk.prompt_token_ids, chunk.model
        logprobs, prompt_logprobs = chat_choice.logprobs, chunk.prompt_logprobs
    else:
        completion = parse_shape(Completion, event)
        choice = _only_choice(completion.choices)
        text, token_ids, finish = choice.text, choice.token_ids, choice.finish_reason
        prompt_ids, model = choice.prompt_token_ids, completion.model
        logprobs, prompt_logprobs = choice.logprobs, choice.prompt_logprobs
    if token_ids is None:
        raise ShapeError("a chunk without the token_ids the proxy asked for")
    return Piece(text, list(token_ids), finish,
                 None if prompt_ids is None else list(prompt_ids), model, logprobs,
                 prompt_logprobs)


def prefill_prompt_ids(answer: Any, chat: bool, instance: Instance) -> list[int]:
    """The prompt's token ids from a whole (prefill) answer; a ValueError when the
    answer is not one or names ids outside the instance's vocabulary."""
    prompt_ids: list[int] | None
    if chat:
        chat_answer = parse_shape(ChatCompletion, answer)
        _only_choice(chat_answer.choices)
        prompt_ids = chat_answer.prompt_token_ids
    else:
        completion = parse_shape(Completion, answer)
        prompt_ids = _only_choice(completion.choices).prompt_token_ids
    if not prompt_ids:
        raise ShapeError("a prefill answer without the prompt_token_ids the proxy asked for")
    _check_vocabulary(prompt_ids, instance, "prompt token id")
    return list(prompt_ids)


@dataclass(frozen=True)
class RequestLimits:
    """What the client's request says about how its output may end."""

    max_tokens: int | None
    ignore_eos: bool
    has_stop_strings: bool
    stop_token_ids: frozenset[int]
    min_tokens: int = 0
    has_grammar: bool = False

    @classmethod
    def of(cls, body: dict[str, Any], max_tokens: int | None) -> RequestLimits:
        """From a request body an instance accepted (so its fields are well typed)."""
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        stop_ids = body.get("stop_token_ids")
        stop_ids = stop_ids if isinstance(stop_ids, list) else []
        min_tokens = body.get("min_tokens")
        return cls(max_tokens if isinstance(max_tokens, int) else None,
                   body.get("ignore_eos") is True, any(stops),
                   frozenset(i for i in stop_ids if isinstance(i, int)),
                   min_tokens if isinstance(min_tokens, int) else 0,
                   any(body.get(k) is not None for k in GRAMMAR_KEYS))


@dataclass
class StreamCheck:
    """Checks each piece of one upstream stream before the proxy takes it.

    `generated` is the request's list of tokens already taken (shared, so it grows
    as pieces are taken); `prompt` the client prompt's ids when known. A
    continuation's first piece must name `prompt + generated` as its prompt."""

    limits: RequestLimits
    instance: Instance
    prompt: list[int] | None
    generated: list[int]
    continuation: bool = False
    first: bool = field(default=True, init=False)

    def __call__(self, piece: Piece) -> None:
        if self.first:
            self._check_prompt(piece)
            self.first = False
        ids = piece.token_ids
        _check_vocabulary(ids, self.instance, "token id")
        total = len(self.generated) + len(ids)
        limits = self.limits
        if limits.max_tokens is not None and total > limits.max_tokens:
            raise ImpossibleOutput(f"{total} tokens for max_tokens={limits.max_tokens}")
        room = self._room()
        if room is not None and total > room:
            raise ImpossibleOutput(f"{total} tokens where max_model_len leaves room for {room}")
        ends = piece.finish_reason is not None
        stopping = [i for i in (ids[:-1] if ends else ids) if i in limits.stop_token_ids]
        if stopping:
            raise ImpossibleOutput(f"stop token id {stopping[0]} did not end the request")
        if not ends:
            return
        if piece.finish_reason not in ENGINE_FINISH_REASONS:
            raise ImpossibleOutput(f"finish_reason {piece.finish_reason!r}")
        if piece.finish_reason == "length" and not self._at_a_limit(total, room):
            raise ImpossibleOutput(f"finish_reason 'length' after {total} tokens "
                                   f"(max_tokens={limits.max_tokens}, room={room})")
        if piece.finish_reason == "stop" and not limits.has_stop_strings \
                and not limits.has_grammar:
            self._check_stop(ids, total)

    def _check_stop(self, ids: list[int], total: int) -> None:
        """A `stop` finish of a request without stop strings or a grammar."""
        limits = self.limits
        if total < limits.min_tokens:
            raise ImpossibleOutput(f"finish_reason 'stop' after {total} tokens, before "
                                   f"min_tokens={limits.min_tokens}")
        last = ids[-1] if ids else (self.generated[-1] if self.generated else None)
        if limits.ignore_eos and last not in limits.stop_token_ids:
            raise ImpossibleOutput("finish_reason 'stop' under ignore_eos without a stop "
                                   "string or stop token id")

    def _check_prompt(self, piece: Piece) -> None:
        got = piece.prompt_token_ids
        if got is None:
            raise ShapeError("a first chunk without the prompt_token_ids the proxy asked for")
        _check_vocabulary(got, self.instance, "prompt token id")
        if self.prompt is None:
            self.prompt = list(got)  # the client prompt, now known
            return
        want = self.prompt + self.generated if self.continuation else self.prompt
        if got != want:
            raise ImpossibleOutput("the instance names another prompt than the one it was given")

    def _room(self) -> int | None:
        """Output tokens the instance's max_model_len leaves for this prompt."""
        if self.instance.max_model_len is None or self.prompt is None:
            return None
        return self.instance.max_model_len - len(self.prompt)

    def _at_a_limit(self, total: int, room: int | None) -> bool:
        if self.limits.max_tokens is not None:
            if total >= self.limits.max_tokens:
                return True
            if room is None:  # before max_tokens only the context explains it: unknown here
                return False
        return room is None or total >= room  # an unknown room may have been reached


def _only_choice(choices: list[Choice]) -> Choice:
    if len(choices) != 1 or choices[0].index != 0:
        raise ShapeError(f"{len(choices)} choices where the proxy asked for one (index 0)")
    return choices[0]


def _check_vocabulary(token_ids: list[int], instance: Instance, what: str) -> None:
    bound = instance.vocab_size or MAX_TOKEN_ID_UNKNOWN_VOCAB + 1
    for token_id in token_ids:
        if not 0 <= token_id < bound:
            raise ImpossibleOutput(f"{what} {token_id} outside [0, {bound})")
