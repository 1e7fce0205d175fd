"""OpenAI-compatible request records, their validation, and the error format.

Requests are validated strictly (a string where a number belongs is a 400, not a
coercion; a lone surrogate in a prompt, a message or a stop string, or a NUL outside
a stop string, is a 400 naming the field) and turned into a prompt plus `SamplingParams`
for the engine. Every error leaves the server as `{"error": {"message", "type",
"code", "param"}}`. A field vLLM or OpenAI define is honoured or, where kvrecover does
not do what it asks (beam search, `best_of` above `n`, chat's fields on completions),
a 400 naming it; a field nobody defines is ignored, as vLLM ignores it, with a warning
once per name and the IGNORED_FIELDS_HEADER header on the answer (`ignored_fields`).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, ValidationError

from kvrecover.kv_transfer.p2p.params import parse_reference, wants_remote_prefill
from kvrecover.sampling import MAX_LOGPROBS, SamplingParams
from kvrecover.tokenizer import check_text

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 4 << 20  # a request body larger than this is a 413
# Names the tool-call parser of an answer whose tool calls stay raw text (`raw_tool_calls`).
TOOL_CALL_PARSER_HEADER = "x-kvrecover-tool-call-parser"
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a `seed` is a signed 64-bit integer, as in vLLM
# vLLM's older structured-output fields -> the `structured_outputs` kind each one is.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Names, comma-separated, the request's fields the server does not know and ignored.
IGNORED_FIELDS_HEADER = "x-kvrecover-ignored-fields"


class ApiError(Exception):
    """An error answered in OpenAI's format with an HTTP status."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 code: str | int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code if code is not None else status
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "code", "param"}}`; text that
        has no UTF-8 form (a lone surrogate echoed from the request) is escaped."""
        return {"error": {"message": _utf8_safe(self.message), "type": self.error_type,
                          "code": self.code, "param": _utf8_safe(self.param)}}


def _utf8_safe(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_context(field: str, value: int | None, prompt_tokens: int, max_model_len: int) -> None:
    """A 400 naming `field` when `value` new tokens plus the prompt exceed the context, as
    vLLM answers (None, or a prompt too long by itself, is left to the engine)."""
    if value is None or prompt_tokens >= max_model_len or value + prompt_tokens <= max_model_len:
        return
    raise ApiError(400, f"{field}={value} plus the prompt's {prompt_tokens} tokens exceeds the "
                        f"model's context of {max_model_len} tokens", param=field)


def checked_text(text: str, field: str) -> str:
    """`text`, or a 400 naming `field` when it holds a lone surrogate or a NUL."""
    try:
        check_text(text, field)
    except ValueError as error:
        raise ApiError(400, str(error), param=field) from error
    return text


def checked_stop(text: str, field: str) -> str:
    """A stop string, or a 400 naming `field` when it holds a lone surrogate (which no
    output holds). A NUL may be in one: it is never tokenized, only matched against
    decoded text, which can hold it (a byte-level token of byte 0)."""
    checked_text(text.replace("\x00", " "), field)  # the same message and position
    return text


class StreamOptions(BaseModel):
    """`stream_options` of a streamed request, as in OpenAI and vLLM: `include_usage`
    adds a last chunk with empty `choices` and the `usage`; `continuous_usage_stats`
    (vLLM's) also puts the usage so far on every chunk."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def stream_usage(stream: bool, options: StreamOptions | None) -> tuple[bool, bool]:
    """(a final usage chunk, usage on every chunk) of a request; non-empty
    `stream_options` on a request that does not stream is a 400, as in vLLM."""
    if options is None:
        return False, False
    if not stream:
        if options.model_fields_set:
            raise ApiError(400, "stream_options is only allowed with stream=true",
                           param="stream_options")
        return False, False
    final = bool(options.include_usage)
    return final, final and bool(options.continuous_usage_stats)


def parse_stream_usage(body: dict[str, Any]) -> tuple[bool, bool]:
    """`stream_usage` of a raw JSON body (the proxy's view of a request)."""
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, f"stream_options must be an object, got {options!r:.80}",
                           param="stream_options")
        options = parse_request(StreamOptions, options)
    return stream_usage(body.get("stream") is True, options)


class _GenerationFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    min_tokens: int = 0  # vLLM's
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    prompt_logprobs: int | None = None  # vLLM's
    min_p: float | None = None  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's
    # vLLM's, accepted only at their no-op values (no beam search, one sample per choice).
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Structured outputs (checked by `openai/structured.py`): OpenAI's and vLLM's fields,
    # and vLLM's older `guided_*` spelling of `structured_outputs` (`structured_fields`).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's P2P reference (`kv_transfer/p2p/params.py`): a consumer pulls the prompt's
    # KV from the producer it names (`do_remote_prefill`), checked at request time.
    kv_transfer_params: dict[str, Any] | None = None

    def checked_kv_transfer_params(self) -> dict[str, Any] | None:
        """`kv_transfer_params`; a pull (`do_remote_prefill: true`) whose reference is
        malformed (a field missing or of the wrong type or range) is a 400 naming it."""
        params = self.kv_transfer_params
        if wants_remote_prefill(params):
            try:
                parse_reference(params)
            except ValueError as error:
                raise ApiError(400, str(error), param="kv_transfer_params") from error
        return params

    def structured_fields(self) -> tuple[Any, Any, str | None]:
        """(`response_format`, `structured_outputs`, the field that set them): a
        `guided_*` field becomes `structured_outputs` of its kind; two of them, or one
        with `response_format` or `structured_outputs`, are a 400 naming it."""
        guided = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if not guided:
            if self.response_format is not None:
                return self.response_format, self.structured_outputs, "response_format"
            if self.structured_outputs is not None:
                return None, self.structured_outputs, "structured_outputs"
            return None, None, None
        name = guided[-1]
        if len(guided) > 1:
            raise ApiError(400, f"give one of {', '.join(GUIDED_FIELDS)}, not "
                                f"{' and '.join(guided)}", param=name)
        for other in ("response_format", "structured_outputs"):
            if getattr(self, other) is not None:
                raise ApiError(400, f"give {name} or {other}, not both", param=name)
        value = getattr(self, name)
        if name == "guided_json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ApiError(400, f"guided_json must be a JSON schema (an object or its "
                                    f"JSON text): {error}", param=name) from error
        return None, {GUIDED_FIELDS[name]: value}, name

    def check_unsupported(self) -> None:
        """A 400 naming a vLLM field set to what kvrecover does not do: `best_of` other
        than `n`, beam search, and `length_penalty` (used by beam search only)."""
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"best_of={self.best_of} is not supported: each choice is "
                                f"one sample (best_of must equal n={self.n}, or be left out)",
                           param="best_of")
        if self.use_beam_search:
            raise ApiError(400, "use_beam_search is not supported (no beam search)",
                           param="use_beam_search")
        if self.length_penalty != 1.0:
            raise ApiError(400, f"length_penalty={self.length_penalty} needs beam search, "
                                "which is not supported (leave it at 1)",
                           param="length_penalty")

    def stream_usage(self) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk); see `stream_usage`."""
        return stream_usage(self.stream, self.stream_options)

    def stop_strings(self) -> list[str]:
        """The `stop` strings as a list (empty ones dropped)."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [checked_stop(self.stop, "stop")] if self.stop else []
        return [checked_stop(s, f"stop[{i}]") for i, s in enumerate(self.stop) if s]

    def output_logprobs(self) -> int | None:
        """Top logprobs per output token, or None for none (per endpoint)."""
        raise NotImplementedError

    def scored_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token (vLLM's `prompt_logprobs`; completions' `echo`
        with `logprobs` asks too), or None."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, max_tokens_field: str = "max_tokens"
                        ) -> SamplingParams:
        """The engine's sampling parameters; a bad value is an ApiError naming the field
        (`max_tokens_field`: the request's field that `max_tokens` came from)."""
        self.check_unsupported()
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ApiError(400, f"stop takes at most 4 strings, got {len(self.stop)}",
                           param="stop")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ApiError(400, f"seed must be a signed 64-bit integer (in [{SEED_RANGE[0]}, "
                                f"{SEED_RANGE[1]}]), got {self.seed}", param="seed")
        # A continuation's resumed tokens count as output toward min_tokens (and max_tokens
        # is what is left), as the engine counts them.
        bound = max_tokens + self.resumed_output_count()
        if max_tokens >= 0 and self.min_tokens > bound:
            raise ApiError(400, f"min_tokens={self.min_tokens} must be at most "
                                f"{max_tokens_field}={bound}", param="min_tokens")
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                max_tokens=max_tokens,
                seed=self.seed,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                n=self.n,
                logprobs=self.output_logprobs(),
                prompt_logprobs=self.scored_prompt_logprobs(),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(1.0 if self.repetition_penalty is None
                                    else self.repetition_penalty),
                min_tokens=self.min_tokens,
                logit_bias=self._logit_bias(),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                min_p=0.0 if self.min_p is None else self.min_p,
                kv_transfer_params=self.checked_kv_transfer_params(),
            )
        except ValueError as error:
            message = str(error)
            param = message.split(" ", 1)[0]
            if param == "max_tokens" and max_tokens_field != param:
                param, message = max_tokens_field, max_tokens_field + message[len("max_tokens"):]
            raise ApiError(400, message, param=param) from error

    def resumed_output_count(self) -> int:
        """Output tokens of an earlier generation that end the prompt (completions')."""
        return 0

    def _logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` with its keys (JSON strings) as token ids; a 400 otherwise."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise ApiError(400, f"logit_bias keys must be token ids (decimal integers), "
                                    f"got {key!r:.40}", param="logit_bias")
            bias[int(key)] = value
        return bias


class CompletionRequest(_GenerationFields):
    """A `/v1/completions` request."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    # Chat's fields, a 400 naming them here (`check_unsupported`): not silently ignored.
    max_completion_tokens: Any = None
    top_logprobs: Any = None
    # kvrecover's own: write the logprobs in chat's shape (a chat request the proxy
    # continues as a completion).
    chat_logprobs: bool = False
    # kvrecover's own: the last `resumed_output_tokens` prompt tokens are output of an
    # earlier generation (a request the proxy migrated), of which `resumed_output_text`
    # reached the client; the new text continues theirs, and a seeded request's
    # per-token sampling seeds continue from that position.
    resumed_output_tokens: int = 0
    resumed_output_text: str = ""

    def resumed_output_count(self) -> int:
        return max(0, self.resumed_output_tokens)

    def resumed_token_ids(self) -> list[int]:
        """The resumed output tokens (the prompt's tail); a 400 when they do not fit."""
        count = self.resumed_output_tokens
        if count == 0:
            return []
        checked_text(self.resumed_output_text, "resumed_output_text")
        prompt = self.prompt
        if count < 0 or not isinstance(prompt, list) or not prompt or \
                not isinstance(prompt[0], int) or count >= len(prompt):
            raise ApiError(400, "resumed_output_tokens must be >= 0 and shorter than a "
                                f"token-id prompt, got {count}", param="resumed_output_tokens")
        return list(prompt[-count:])

    def check_unsupported(self) -> None:
        """Also a 400 for chat's `max_completion_tokens` and `top_logprobs`."""
        if self.max_completion_tokens is not None:
            raise ApiError(400, "max_completion_tokens is a chat completions field; "
                                "/v1/completions takes max_tokens",
                           param="max_completion_tokens")
        if self.top_logprobs is not None:
            raise ApiError(400, "top_logprobs is a chat completions field; /v1/completions "
                                "takes logprobs: <number of top logprobs>",
                           param="top_logprobs")
        super().check_unsupported()

    def output_logprobs(self) -> int | None:
        """`logprobs`: top logprobs per token (OpenAI allows 0..5; kvrecover up to 20)."""
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                                f"{self.logprobs}", param="logprobs")
        return self.logprobs

    def scored_prompt_logprobs(self) -> int | None:
        """With `echo`, the prompt's logprobs come with `logprobs` (scoring the prompt
        alone when max_tokens is 0, as lm-eval asks); else vLLM's `prompt_logprobs`."""
        if self.echo and self.prompt_logprobs is None:
            if self.logprobs is not None:
                return self.output_logprobs()
            if self.max_tokens == 0:
                return 0  # the prompt is echoed alone: nothing to generate
        return self.prompt_logprobs

    def engine_prompt(self) -> str | dict[str, list[int]]:
        """The one prompt, as the engine takes it; a batch of prompts is a 400."""
        prompt = self._single_prompt()
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.echo and self.resumed_output_tokens:
            raise ApiError(400, "echo does not go with resumed_output_tokens", param="echo")
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            return checked_text(prompt, "prompt")
        if not prompt:
            raise ApiError(400, "prompt must not be an empty list of token ids", param="prompt")
        return {"prompt_token_ids": list(prompt)}

    def _single_prompt(self) -> str | list[int]:
        """The request's one prompt, text or token ids; a batch of several is a 400."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        first = prompt[0] if prompt else None
        if isinstance(first, (str, list)):  # a batch: list[str] or list[list[int]]
            if len(prompt) != 1:
                raise ApiError(400, f"prompt must be one prompt, got a batch of {len(prompt)}",
                               param="prompt")
            return first
        # Validation chose list[int] (the union's lists are homogeneous): all are ints.
        return [token_id for token_id in prompt if isinstance(token_id, int)]

    def max_new_tokens(self) -> int:
        """`max_tokens`, or OpenAI's default of 16."""
        return DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class ChatMessage(BaseModel):
    """One message of a chat."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None

    def text(self, field: str) -> str:
        """The content as plain text (text parts joined; other parts are a 400);
        `field` ("messages[i].content") names it in errors."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return checked_text(self.content, field)
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "message content parts must be {'type': 'text', 'text': ...}",
                               param=f"{field}[{j}]")
            parts.append(checked_text(part["text"], f"{field}[{j}].text"))
        return "".join(parts)


class ChatCompletionRequest(_GenerationFields):
    """A `/v1/chat/completions` request."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None  # checked by `openai/tools.py`
    tool_choice: Any = None
    # vLLM's: the answer starts with the last message's content when that message is the
    # assistant's (`echoed_text`).
    echo: bool = False
    # kvrecover's own (the proxy's): leave tool calls as the model's text in `content`
    # and name the parser in the TOOL_CALL_PARSER_HEADER header.
    raw_tool_calls: bool = False

    def output_logprobs(self) -> int | None:
        """`top_logprobs` (0..20) when `logprobs` is true, as in OpenAI."""
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                                f"{top}", param="top_logprobs")
        if not self.logprobs:
            if top:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return top or 0


    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (an assistant's earlier tool
        calls with their arguments as objects, as Hugging Face templates read them)."""
        if not self.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        conversation: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            message: dict[str, Any] = {"role": m.role,
                                       "content": m.text(f"messages[{i}].content")}
            if m.tool_calls is not None:
                message["tool_calls"] = _template_tool_calls(m.tool_calls, i)
            if m.tool_call_id is not None:
                message["tool_call_id"] = checked_text(m.tool_call_id,
                                                       f"messages[{i}].tool_call_id")
            if m.name is not None:
                message["name"] = checked_text(m.name, f"messages[{i}].name")
            conversation.append(message)
        return conversation

    def max_tokens_field(self) -> tuple[str, int | None]:
        """The field that bounds the output and its value: `max_completion_tokens` when
        set, else `max_tokens` (None: neither)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def max_new_tokens(self, room: int) -> int:
        """`max_completion_tokens` or `max_tokens`, else all the `room` left in the context."""
        value = self.max_tokens_field()[1]
        return room if value is None else value

    def echoed_text(self, conversation: list[dict[str, Any]]) -> str | None:
        """With `echo`, the text the answer starts with: the last message's content when
        it is the assistant's (the role the answer has), as vLLM; else None."""
        if not self.echo or not conversation or conversation[-1]["role"] != "assistant":
            return None
        return conversation[-1]["content"] or None


def _template_tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` for the chat template: each
    `{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}` with
    its arguments decoded (a 400 naming the call when they are not a JSON object)."""
    rendered = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{where} must be {{'type': 'function', 'function': "
                                "{'name': ..., 'arguments': ...}}", param=where)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:
                raise ApiError(400, f"{where}.function.arguments must be JSON text: {error}",
                               param=f"{where}.function.arguments") from error
        if not isinstance(arguments, dict):
            raise ApiError(400, f"{where}.function.arguments must be a JSON object",
                           param=f"{where}.function.arguments")
        rendered.append({**call, "type": "function",
                         "function": {"name": function["name"], "arguments": arguments}})
    return rendered


MAX_WARNED_FIELDS = 1000  # names warned about; past them, no more warnings (memory)
MAX_IGNORED_HEADER_CHARS = 2000  # the header names the first fields that fit
_warned_fields: set[str] = set()


def ignored_fields(model: type[BaseModel], body: dict[str, Any]) -> list[str]:
    """The fields of a request `body` that `model` does not know, sorted: ignored, as
    vLLM ignores them, with a warning logged once per field name (the server names them
    in the IGNORED_FIELDS_HEADER header of its answer, `ignored_fields_header`)."""
    unknown = sorted(str(key) for key in body if key not in model.model_fields)
    for name in unknown:
        if name not in _warned_fields and len(_warned_fields) < MAX_WARNED_FIELDS:
            _warned_fields.add(name)
            logger.warning("ignoring the unknown request field %r (logged once per field "
                           "name; answers name their ignored fields in %s)",
                           _utf8_safe(name), IGNORED_FIELDS_HEADER)
    return unknown


def ignored_fields_header(names: list[str]) -> dict[str, str]:
    """The IGNORED_FIELDS_HEADER header naming `names` (none: no header): comma-separated,
    each percent-encoded (a comma, a space or a non-ASCII character in a name cannot
    break the header), as many as fit in MAX_IGNORED_HEADER_CHARS, then `...`."""
    if not names:
        return {}
    value = ""
    for name in names:
        quoted = quote(name, safe="")
        if len(value) + len(quoted) + 1 > MAX_IGNORED_HEADER_CHARS:
            value += ",..."
            break
        value = f"{value},{quoted}" if value else quoted
    return {IGNORED_FIELDS_HEADER: value}


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; any problem is a 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(400, f"{field}: {first['msg']} (got {first.get('input')!r:.80})",
                       param=field) from error
