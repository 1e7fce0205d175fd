"""Structured outputs: a request's grammar (JSON schema, regex, choice, EBNF) compiled by
`xgrammar`, its matcher state, and the per-step token bitmask the sampler applies.

`params` is the request-side record (`StructuredOutputsParams`, on `SamplingParams`);
`compiler` compiles and caches grammars for one checkpoint's tokenizer; `state` is one
request's matcher (the engine advances it as tokens are appended); `bitmask` fills a
step's masks on the host and applies them to the logits on the device (the model
runner calls it before sampling). Only `compiler` and `state` import xgrammar, lazily:
a request without a grammar never needs it.
"""
