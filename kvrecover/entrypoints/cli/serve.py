"""`kvrecover serve`: its flags (named as in `vllm serve`) and its main.

The engine flags are `EngineArgs`' own, so `serve` takes every engine option under
the same name as `LLM(...)` and `kvrecover generate`; the address flags are
`ListenArgs`', the HTTP ones `ServeArgs`': all declared once (`kvrecover.options`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrecover.device_defaults import SERVE_CPU_MAX_NUM_BATCHED_TOKENS
from kvrecover.entrypoints.cli.listen import ListenArgs, run_app
from kvrecover.entrypoints.openai.tool_parsers import PARSERS
from kvrecover.options import add_record_flags, from_namespace, option, redacted, validate

if TYPE_CHECKING:
    from kvrecover.config import EngineArgs

API_KEY_ENV = "KVRECOVER_API_KEY"


@dataclass
class ServeArgs:
    """The HTTP flags of `kvrecover serve` besides the engine's and the address."""

    served_model_name: str | None = option(
        None, "the model name clients send (default: --model, or the built-in model's name)",
        str, nullable=True, metavar="NAME")
    api_key: str | None = option(
        None, f"require 'Authorization: Bearer KEY' on /v1/* (or ${API_KEY_ENV})", str,
        nullable=True, metavar="KEY", shown=redacted, repr=False)
    tool_call_parser: str = option(
        "auto", "how tool calls of tool_choice='auto' are parsed: auto (from the chat "
        "template and the model family), hermes (Qwen 2.5/3) or llama3_json (Llama 3)", str,
        choices=("auto", *PARSERS))

    def __post_init__(self) -> None:
        validate(self)


def add_serve_parser(commands: Any) -> None:
    """Register `kvrecover serve` on the CLI's subparsers."""
    from kvrecover.config import EngineArgs

    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_record_flags(serve, EngineArgs, ListenArgs, ServeArgs)


def serving_engine_args(engine_args: EngineArgs) -> EngineArgs:
    """The engine options `serve` runs: the user's, with the server's step budget on the
    CPU (`SERVE_CPU_MAX_NUM_BATCHED_TOKENS`) where `--max-num-batched-tokens` is unset."""
    import torch

    on_gpu = engine_args.device.startswith("cuda") or (
        engine_args.device == "auto" and torch.cuda.is_available())
    if engine_args.max_num_batched_tokens is not None or on_gpu:
        return engine_args
    return dataclasses.replace(engine_args,
                               max_num_batched_tokens=SERVE_CPU_MAX_NUM_BATCHED_TOKENS)


def run_serve(args: argparse.Namespace) -> int:
    """Start the engine, then serve HTTP until interrupted."""
    from kvrecover import LLM
    from kvrecover.config import engine_args_from_namespace
    from kvrecover.default_model import MODEL_NAME
    from kvrecover.entrypoints.server.app import ServerConfig, build_app
    from kvrecover.entrypoints.server.engine_loop import EngineLoop

    engine_args = serving_engine_args(engine_args_from_namespace(args))
    listen = from_namespace(ListenArgs, args)
    serve = from_namespace(ServeArgs, args)
    loop = EngineLoop(lambda: LLM.from_engine_args(engine_args))
    loop.start()
    # unset engine flags are not in the namespace (see add_flags)
    name = serve.served_model_name or getattr(args, "model", None) or MODEL_NAME
    api_key = serve.api_key or os.environ.get(API_KEY_ENV) or None
    app = build_app(loop, ServerConfig(name, api_key, tool_call_parser=serve.tool_call_parser))
    print(f"kvrecover serve: {name} on {listen.url}", file=sys.stderr, flush=True)
    try:
        run_app(app, listen)
    finally:
        loop.stop()
    return 0
