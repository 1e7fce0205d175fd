"""A rank process that dies at start-up or stays silent is a RankFailedError within the
deadline, never a hang; its exit is reported the way it happened."""

from __future__ import annotations

import time

import pytest

from kvrecover.distributed.errors import RankFailedError
from kvrecover.distributed.rank_process import RankProcess


def test_a_rank_that_dies_at_start_up_is_reported_at_once():
    process = RankProcess.start(1, "kvrecover_no_such_module")
    started = time.monotonic()
    try:
        with pytest.raises(RankFailedError, match=r"rank 1 died \(exit code 1\) while starting"):
            process.receive(30.0, "starting")
        assert time.monotonic() - started < 15
    finally:
        process.stop(0.0)


def test_a_silent_rank_misses_its_deadline():
    process = RankProcess.start(1, "timeit")  # runs a while, never writes to its channel
    try:
        with pytest.raises(RankFailedError, match=r"rank 1 missed its 0.05 s deadline "
                                                  r"\(stopped or hung\?\) while starting"):
            process.receive(0.05, "starting")
    finally:
        process.stop(0.0)
    assert process.exit_status() is not None
