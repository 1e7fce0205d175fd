"""Containing connector bugs: log each kind of failure once, count them all."""

from __future__ import annotations

import logging


class ConnectorErrorLog:
    """Logs the first connector failure of each kind in full, later ones at debug level.

    The scheduler and the model runner each keep one. A connector that fails on
    every step must not flood the log, yet the first occurrence of every distinct
    kind (a method name, or a contract that an answer broke) is worth a traceback.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[str] = set()
        self.num_errors = 0  # every failure reported since the last `take_count`

    def report(self, kind: str, message: str, *, exc_info: bool = False,
               level: int = logging.ERROR) -> None:
        """Record one failure of `kind`; call it from inside the `except` for a traceback."""
        self.num_errors += 1
        if kind in self._seen:
            self._logger.debug("KV connector %s: %s", kind, message, exc_info=exc_info)
            return
        self._seen.add(kind)
        self._logger.log(
            level, "KV connector %s: %s (later %s reports are logged at debug level)",
            kind, message, kind, exc_info=exc_info,
        )

    def take_count(self) -> int:
        """Failures since the last call (for the engine's counters)."""
        count, self.num_errors = self.num_errors, 0
        return count


def checked_block_ids(value: object, num_blocks: int) -> set[int]:
    """`get_block_ids_with_load_errors`'s answer as a set of valid block ids.

    Raises ValueError for anything else (not an iterable of ints in [1, num_blocks)),
    None included (the contract's answer for "nothing failed" is an empty set): a
    garbled report tells nothing about which blocks failed.
    """
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"expected a set of block ids, got {value!r}")
    block_ids = set()
    for block_id in value:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise ValueError(f"block id {block_id!r} is not an int")
        if not 0 < block_id < num_blocks:
            raise ValueError(f"block id {block_id} is outside the cache [1, {num_blocks})")
        block_ids.add(block_id)
    return block_ids


def checked_counters(value: object) -> dict[str, int]:
    """`get_connector_stats`'s answer as {counter name: int increment}; ValueError for
    anything else."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"expected a dict of counters, got {value!r}")
    for name, count in value.items():
        if not isinstance(name, str) or isinstance(count, bool) or not isinstance(count, int):
            raise ValueError(f"counter {name!r}: {count!r} is not a str name with an int count")
    return dict(value)


def checked_request_ids(value: object) -> set[str]:
    """A set of request ids from `get_finished`; ValueError for anything else."""
    if value is None:
        return set()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"expected a set of request ids, got {value!r}")
    request_ids = set(value)
    if not all(isinstance(request_id, str) for request_id in request_ids):
        raise ValueError(f"request ids must be strings, got {sorted(map(repr, request_ids))}")
    return request_ids
