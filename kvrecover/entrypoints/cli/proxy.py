"""`kvrecover proxy`: its flags (`ProxyConfig`'s and `ListenArgs`') and its main."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvrecover.entrypoints.cli.listen import ListenArgs, run_app
from kvrecover.options import add_record_flags, from_namespace


def add_proxy_parser(commands: Any) -> None:
    """Register `kvrecover proxy` on the CLI's subparsers."""
    from kvrecover.entrypoints.proxy.config import ProxyConfig

    proxy = commands.add_parser(
        "proxy", help="prefill/decode proxy with failover and mid-stream migration")
    add_record_flags(proxy, ProxyConfig, ListenArgs)


def run_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until interrupted."""
    from kvrecover.entrypoints.proxy.app import build_proxy_app
    from kvrecover.entrypoints.proxy.config import ProxyConfig

    config = from_namespace(ProxyConfig, args)
    listen = from_namespace(ListenArgs, args)
    app = build_proxy_app(config)
    print(f"kvrecover proxy: {listen.url} -> prefill {config.prefill}, "
          f"decode {config.decode}", file=sys.stderr, flush=True)
    run_app(app, listen)
    return 0
