"""The serving subcommands of the CLI: `serve`, `proxy`, `serve-demo`.

Only argparse is imported here; each command imports its HTTP stack when it runs,
so `kvrecover --help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_serving_parsers(commands: Any) -> None:
    """Register the serving subcommands on the CLI's subparsers."""
    from kvrecover.entrypoints.demo import add_demo_parser
    from kvrecover.entrypoints.proxy_command import add_proxy_parser
    from kvrecover.entrypoints.serve_command import add_serve_parser

    add_serve_parser(commands)
    add_proxy_parser(commands)
    add_demo_parser(commands)


def run_serving_command(args: argparse.Namespace) -> int:
    """Run `serve`, `proxy` or `serve-demo` from parsed arguments."""
    if args.command == "serve":
        from kvrecover.entrypoints.serve_command import run_serve

        return run_serve(args)
    if args.command == "proxy":
        from kvrecover.entrypoints.proxy_command import run_proxy

        return run_proxy(args)
    if args.command == "serve-demo":
        from kvrecover.entrypoints.demo import run_demo

        return run_demo(args)
    raise ValueError(f"unknown serving command {args.command!r}")
