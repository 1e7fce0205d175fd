"""The settings of `kvrecover proxy`, declared once (`kvrecover.options`): they are its
flags (`--prefill`, `--max-retries`, ...) and what `build_proxy_app` takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrecover.entrypoints.openai.protocol import MAX_BODY_BYTES
from kvrecover.options import option, validate


def _url_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _urls_problem(urls: list[Any]) -> str | None:
    return None if all(isinstance(url, str) and url for url in urls) else "a list of URLs"


def _urls(default: list[str], help: str) -> Any:
    return option(default, help, list, parse=str, nargs="+", metavar="URL",
                  convert=_url_list, check=_urls_problem)


@dataclass
class ProxyConfig:
    """Where the instances are and how hard the proxy tries them."""

    prefill: list[str] = _urls([], "prefill instances (kvrecover serve, kv_producer)")
    decode: list[str] = _urls([], "decode instances (kvrecover serve, kv_consumer)")
    max_retries: int = option(2, "other instances tried per step after a failure", int,
                              minimum=0)
    timeout: float = option(60.0, "seconds an instance may stay silent", float, above=0)
    health_check_interval: float = option(
        2.0, "seconds between health checks of every instance", float, above=0)
    max_body_bytes: int = option(MAX_BODY_BYTES, "a request body larger than this is a 413",
                                 int, minimum=1, flag=False)

    def __post_init__(self) -> None:
        validate(self)
