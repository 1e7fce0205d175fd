"""`kvrecover serve`: its flags (named as in `vllm serve`) and its main.

`add_engine_flags` / `engine_kwargs` are the one place that maps engine flags to
`LLM(...)` keyword arguments for the serving commands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

API_KEY_ENV = "KVRECOVER_API_KEY"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine flags of `kvrecover serve` (vLLM's names)."""
    parser.add_argument("--model", default=None,
                        help="local Hugging Face checkpoint folder (default: built-in model)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: auto)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto = float32 on CPU, bf16 on GPU")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="numerics independent of batch composition (exact recovery on GPU)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="requests decoded together (default: 64 on CPU, 256 on GPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output in tokens (default: the model's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens computed per step; longer prompts prefill in chunks")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="KV cache budget in GiB (default: from free memory)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--seed", type=int, default=0, help="engine seed")
    parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help='KVTransferConfig as JSON, e.g. {"kv_connector": '
                             '"SharedStorageConnector", "kv_role": "kv_consumer", '
                             '"kv_connector_extra_config": {"shared_storage_path": "/kv"}}')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(...)` keyword arguments from the parsed engine flags."""
    from kvrecover.config import KVTransferConfig

    transfer = None
    if args.kv_transfer_config:
        try:
            raw = json.loads(args.kv_transfer_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {error}") from error
        if not isinstance(raw, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        try:
            transfer = KVTransferConfig(**raw)
        except TypeError as error:
            raise ValueError(f"--kv-transfer-config: {error}") from error
    return {
        "model": args.model, "device": args.device, "dtype": args.dtype,
        "batch_invariant": args.batch_invariant, "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size, "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "enforce_eager": args.enforce_eager, "seed": args.seed,
        "kv_transfer_config": transfer,
    }


def add_serve_parser(commands: Any) -> None:
    """Register `kvrecover serve` on the CLI's subparsers."""
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
    from kvrecover.default_model import MODEL_NAME
    from kvrecover.entrypoints.engine_loop import EngineLoop
    from kvrecover.entrypoints.server import ServerConfig, build_app

    kwargs = engine_kwargs(args)
    loop = EngineLoop(lambda: LLM(**kwargs))
    loop.start()
    name = args.served_model_name or args.model or MODEL_NAME
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
