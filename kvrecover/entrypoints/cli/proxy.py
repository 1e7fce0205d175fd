"""`kvrecover proxy`: its flags and its main."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_proxy_parser(commands: Any) -> None:
    """Register `kvrecover proxy` on the CLI's subparsers."""
    proxy = commands.add_parser(
        "proxy", help="prefill/decode proxy with failover and mid-stream migration")
    proxy.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                       help="prefill instances (kvrecover serve, kv_producer)")
    proxy.add_argument("--decode", nargs="+", default=[], metavar="URL",
                       help="decode instances (kvrecover serve, kv_consumer)")
    proxy.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    proxy.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    proxy.add_argument("--max-retries", type=int, default=2,
                       help="other instances tried per step after a failure (default: 2)")
    proxy.add_argument("--timeout", type=float, default=60.0,
                       help="seconds an instance may stay silent (default: 60)")
    proxy.add_argument("--health-check-interval", type=float, default=2.0,
                       help="seconds between health checks of every instance (default: 2)")


def run_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until interrupted."""
    import uvicorn

    from kvrecover.entrypoints.proxy.app import ProxyConfig, build_proxy_app

    config = ProxyConfig(args.prefill, args.decode, args.max_retries, args.timeout,
                         args.health_check_interval)
    app = build_proxy_app(config)
    print(f"kvrecover proxy: http://{args.host}:{args.port} -> prefill {args.prefill}, "
          f"decode {args.decode}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5)
    return 0
