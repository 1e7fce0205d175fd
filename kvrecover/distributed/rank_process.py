"""The process of one rank (1 .. size-1; rank 0 runs in the engine's process) and its
control channel.

A rank is a fresh interpreter (`python -m <module> <fd>`), not a fork of the engine
(torch's threads do not survive a fork) nor a multiprocessing spawn (that re-imports
the user's main script). It talks to rank 0 over one end of a Unix socket pair: rank
0 writes each step's message there and reads the rank's report back, waiting at most
a deadline. The channel doubles as the liveness signal both ways: a rank that dies
closes its end (rank 0 reads EOF at once, never hangs), and a rank whose engine dies
reads EOF and exits (no orphans).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from kvrecover.distributed.errors import RankFailedError
from kvrecover.distributed.messages import Message, unpack

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding kvrecover/


class RankProcess:
    """A running rank: its process and rank 0's end of its channel."""

    def __init__(self, rank: int, process: subprocess.Popen, channel: Connection) -> None:
        self.rank = rank
        self.process = process
        self.channel = channel

    @classmethod
    def start(cls, rank: int, module: str) -> RankProcess:
        """Start `python -m module <fd>` for `rank`; `module` runs the rank's loop
        on the channel it finds at that file descriptor."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", module, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        return cls(rank, process, Connection(ours.detach()))

    def send(self, payload: bytes) -> None:
        """Write one message; a rank that is gone is a `RankFailedError`."""
        try:
            self.channel.send_bytes(payload)
        except OSError as error:
            raise RankFailedError(f"rank {self.rank} is gone ({error})") from error

    def receive(self, timeout_s: float, waiting_for: str) -> Message:
        """The rank's next message within `timeout_s`; a `RankFailedError` naming
        the rank if it died, failed or did not answer in time."""
        if not wait([self.channel], timeout_s):
            raise self.missed_deadline(timeout_s, waiting_for)
        try:
            message = unpack(self.channel.recv_bytes())
        except (EOFError, OSError) as error:
            raise RankFailedError(f"rank {self.rank} died ({self._exit_status()}) "
                                  f"while {waiting_for}") from error
        if message.kind == "failed":
            raise RankFailedError(f"rank {self.rank} failed while {waiting_for}: "
                                  f"{message.body}")
        return message

    def missed_deadline(self, timeout_s: float, waiting_for: str) -> RankFailedError:
        """The error for this rank not answering within `timeout_s` while `waiting_for`."""
        return RankFailedError(f"rank {self.rank} missed its {timeout_s:g} s deadline "
                               f"(stopped or hung?) while {waiting_for}")

    def failure_within(self, timeout_s: float, waiting_for: str) -> RankFailedError | None:
        """The rank's failure if within `timeout_s` it dies or reports one; None if it
        stays silent (it may be waiting in a collective) or answers normally."""
        if not wait([self.channel], timeout_s):
            return None
        try:
            self.receive(0.0, waiting_for)
        except RankFailedError as failure:
            return failure
        return None

    def exit_status(self) -> str | None:
        """How the process ended ("killed by SIGKILL", "exit code 1"), or None while
        it runs; never waits."""
        code = self.process.poll()
        if code is None:
            return None
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def _exit_status(self) -> str:
        code = self.process.poll()
        if code is None:
            try:
                code = self.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                return "closed its channel"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stop(self, grace_s: float) -> None:
        """End the process: wait `grace_s` for it to exit, then kill it; reap it."""
        deadline = time.monotonic() + grace_s
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.channel.close()


def rank_channel(fd: int) -> Connection:
    """A rank's end of its channel, from the descriptor `RankProcess.start` passed."""
    return Connection(fd)
