"""`kvrecover serve`: its flags (named as in `vllm serve`) and its main.

The engine flags are `EngineArgs`' own (`kvrecover.config.add_engine_flags`), so
`serve` takes every engine option under the same name as `LLM(...)` and
`kvrecover generate`; only the HTTP flags are declared here.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

API_KEY_ENV = "KVRECOVER_API_KEY"


def add_serve_parser(commands: Any) -> None:
    """Register `kvrecover serve` on the CLI's subparsers."""
    from kvrecover.config import add_engine_flags

    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: --model, or the "
                            "built-in model's name)")
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on /v1/* (or ${API_KEY_ENV})")


def run_serve(args: argparse.Namespace) -> int:
    """Start the engine, then serve HTTP until interrupted."""
    import uvicorn

    from kvrecover import LLM
    from kvrecover.config import engine_args_from_namespace
    from kvrecover.default_model import MODEL_NAME
    from kvrecover.entrypoints.server.app import ServerConfig, build_app
    from kvrecover.entrypoints.server.engine_loop import EngineLoop

    engine_args = engine_args_from_namespace(args)
    loop = EngineLoop(lambda: LLM.from_engine_args(engine_args))
    loop.start()
    # unset engine flags are not in the namespace (see add_flags)
    name = args.served_model_name or getattr(args, "model", None) or MODEL_NAME
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    app = build_app(loop, ServerConfig(name, api_key))
    print(f"kvrecover serve: {name} on http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=5)
    finally:
        loop.stop()
    return 0
