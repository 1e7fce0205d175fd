"""The `kvrecover` console script's entry point (`pyproject.toml`); the command line
lives in `kvrecover.entrypoints.cli.main`."""

from kvrecover.entrypoints.cli.main import build_parser, describe_error, main

__all__ = ["build_parser", "describe_error", "main"]
