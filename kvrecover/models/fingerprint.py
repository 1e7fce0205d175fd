"""The checkpoint fingerprint: a digest of every weight byte, cached by file identity.

It is part of the KV layout identity (`KVCacheLayout.model_identity`), so KV
stored for other weights of the same architecture (a fine-tune that changed a
single tensor, say) lives under another layout folder and is never loaded.

Each weights file is hashed whole once (xxh3-128 in 16 MiB chunks: 0.05 s for
the 538 MB default model from the page cache, otherwise bound by the disk). The
digest is cached in `<cache root>/checkpoint-digests.json`, keyed by the file's
resolved path and identity (device, inode, size, mtime_ns, ctime_ns), so later
start-ups hash nothing. ctime is in the key because no user tool sets it back
the way `touch -d`, `cp -p` or `rsync -t` restore an mtime after an in-place
edit. A digest is not cached while the file's times lie within the last few
seconds: file times have a clock-tick granularity, so a write in that window
could leave the identity unchanged (git's "racy" rule). The cache is advisory:
a missing, corrupt or unwritable cache file only costs a re-hash, never an
error.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from kvrecover.cache_dir import cache_root
from kvrecover.models.loader import checkpoint_files

logger = logging.getLogger(__name__)

CACHE_FILE_NAME = "checkpoint-digests.json"
CACHE_FORMAT = 1
MAX_CACHE_ENTRIES = 256  # oldest dropped first; a miss only costs a re-hash
MAX_CACHE_FILE_BYTES = 1 << 20  # 256 entries take ~64 KiB
CHUNK_BYTES = 16 << 20
RACY_WINDOW_NS = 3_000_000_000
_IDENTITY_FIELDS = ("device", "inode", "size", "mtime_ns", "ctime_ns")


@dataclass(frozen=True)
class FileIdentity:
    """What must be unchanged for a cached digest of a file to still hold."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        """The identity of the file at `path` (links followed)."""
        info = os.stat(path)
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def settled(self, now_ns: int) -> bool:
        """Whether the file's times are old enough that a later write must change them."""
        return now_ns - max(self.mtime_ns, self.ctime_ns) > RACY_WINDOW_NS


def hash_file(path: Path) -> str:
    """xxh3-128 of every byte of a file, read in large chunks into one reused buffer."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


class DigestCache:
    """The JSON file of cached digests: {resolved path: identity fields + digest}."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict] = {}
        self.changed = False
        try:
            with open(path, "rb") as handle:
                stored = json.loads(handle.read(MAX_CACHE_FILE_BYTES + 1))
        except (OSError, ValueError):  # missing, corrupt or oversized: start empty
            return
        if isinstance(stored, dict) and stored.get("format") == CACHE_FORMAT:
            entries = stored.get("entries")
            if isinstance(entries, dict):
                self.entries = {k: v for k, v in entries.items() if _well_formed(v)}

    def get(self, key: str, identity: FileIdentity) -> str | None:
        """The cached digest of the file at `key`, if its identity is still `identity`."""
        entry = self.entries.get(key)
        if entry is None or {k: entry[k] for k in _IDENTITY_FIELDS} != asdict(identity):
            return None
        return entry["digest"]

    def put(self, key: str, identity: FileIdentity, digest: str) -> None:
        """Remember a digest (as the newest entry); `save` writes it."""
        self.entries.pop(key, None)  # re-inserted last: the newest survives trimming
        self.entries[key] = {**asdict(identity), "digest": digest}
        while len(self.entries) > MAX_CACHE_ENTRIES:
            del self.entries[next(iter(self.entries))]
        self.changed = True

    def save(self) -> None:
        """Write atomically (temporary file + rename); failures are logged and ignored."""
        if not self.changed:
            return
        temporary = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=f".{CACHE_FILE_NAME}.", suffix=".tmp",
                                             dir=self.path.parent)
            os.fchmod(fd, 0o644)  # mkstemp makes it private; the cache may be shared
            with os.fdopen(fd, "w") as handle:
                json.dump({"format": CACHE_FORMAT, "entries": self.entries}, handle)
            os.replace(temporary, self.path)
        except OSError as error:
            logger.debug("checkpoint digest cache %s not written: %s", self.path, error)
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)


def _well_formed(entry: object) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("digest"), str)
            and all(type(entry.get(name)) is int for name in _IDENTITY_FIELDS))


def checkpoint_fingerprint(model_dir: Path) -> str:
    """A digest of a checkpoint's weights: every safetensors file's name, size and
    full-content hash. Costs one read of the weights on first use, a few `stat`
    calls afterwards (see the module docstring for the cache)."""
    cache = DigestCache(cache_root() / CACHE_FILE_NAME)
    fingerprint = xxhash.xxh3_128()
    for path in checkpoint_files(Path(model_dir)):
        key = str(path.resolve())
        before = FileIdentity.of(path)
        digest = cache.get(key, before)
        if digest is None:
            digest = hash_file(path)
            # Cache only a digest of a file that stood still while it was read.
            if FileIdentity.of(path) == before and before.settled(time.time_ns()):
                cache.put(key, before, digest)
        fingerprint.update(f"{path.name}:{before.size}:{digest}\n".encode())
    cache.save()
    return fingerprint.hexdigest()
