"""Where `kvrecover serve` and `kvrecover proxy` listen, and how they run their app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrecover.options import option, validate

DEFAULT_HOST = "127.0.0.1"  # loopback: nothing is exposed unless asked for
DEFAULT_PORT = 8000
GRACEFUL_SHUTDOWN_S = 5  # open requests get this long after Ctrl-C / SIGTERM


@dataclass
class ListenArgs:
    """The address flags of the HTTP commands (`serve`, `proxy`)."""

    host: str = option(DEFAULT_HOST, "bind address", str, check=lambda host: None if host
                       else "a host name or address", metavar="ADDRESS")
    port: int = option(DEFAULT_PORT, "port", int, minimum=0, maximum=65535)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def url(self) -> str:
        """The address as a URL (for the start-up line)."""
        return f"http://{self.host}:{self.port}"


def run_app(app: Any, listen: ListenArgs) -> None:
    """Serve the ASGI `app` on `listen` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=listen.host, port=listen.port, log_level="warning",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
