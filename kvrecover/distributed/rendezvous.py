"""The loopback rendezvous the engine owns: a TCPStore on 127.0.0.1 that rank 0 hosts.

`open_store` binds the preferred port, or, when that one is taken (or none is given),
a free port the OS picks, so a port in use is never a hang. Every rank's process
group is created over that store (`group.create_group`).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def open_store(preferred_port: int | None, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, listening on `preferred_port` if free, else on a free port
    (`store.port` says which). Clients that do not join within `timeout_s` make the
    ranks' group creation fail with an error, never wait forever."""
    timeout = timedelta(seconds=timeout_s)
    if preferred_port:
        try:
            return dist.TCPStore(LOOPBACK, preferred_port, is_master=True, timeout=timeout,
                                 wait_for_workers=False)
        except (RuntimeError, OSError):  # in use (DistNetworkError is a RuntimeError)
            pass
    return dist.TCPStore(LOOPBACK, 0, is_master=True, timeout=timeout,
                         wait_for_workers=False)


def join_store(port: int, timeout_s: float) -> dist.TCPStore:
    """A rank's client of rank 0's store on `port`."""
    return dist.TCPStore(LOOPBACK, port, is_master=False, timeout=timedelta(seconds=timeout_s))
