"""Where kvrecover keeps its per-user cache (converted default model, checkpoint digests)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$KVRECOVER_CACHE` if set, else `~/.cache/kvrecover`; not created here."""
    env = os.environ.get("KVRECOVER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvrecover"
