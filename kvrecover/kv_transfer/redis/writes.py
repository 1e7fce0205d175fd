"""redis-py asyncio connections that offer each large value to the socket uncopied.

redis-py packs a pipeline into a list of chunks (a large value, such as the
`memoryview` of an encoded block entry, is a chunk of its own) and hands the list to
`StreamWriter.writelines`. Before Python 3.12 that joins the chunks into one `bytes`
(a copy of the whole batch), the transport then copies whatever the socket did not
take at once into its buffer, and shifts that buffer as it drains: a 32 MB save ran
at half the rate of redis-py's synchronous client, which sends each chunk straight
from the entry (issue 29; bench/NOTES.md). These connections write chunk by chunk
and let the transport's buffer empty before the next chunk, so every chunk goes to
the socket from the caller's memory; only the part the socket refuses at once is
buffered. The send stays under redis-py's socket timeout and the store's bound on
the whole call.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)


class ChunkedWrites(AbstractConnection):
    """Sends a packed command chunk by chunk, each offered to the socket as it is."""

    async def _send_packed_command(self, command: Iterable[bytes]) -> None:
        writer = self._writer
        if writer is None:  # (redis-py connects before it sends)
            raise redis.ConnectionError("the Redis connection is not open")
        transport = writer.transport
        # Limits of 0: drain() returns once nothing is buffered, so the next chunk's
        # write() sends it from its own memory instead of appending it to the buffer.
        transport.set_write_buffer_limits(high=0)
        for chunk in command:
            writer.write(chunk)
            if transport.get_write_buffer_size():
                await writer.drain()


class ChunkedConnection(ChunkedWrites, Connection):
    """A TCP connection with chunked writes."""


class ChunkedSSLConnection(ChunkedWrites, SSLConnection):
    """A TLS connection with chunked writes."""


class ChunkedUnixDomainSocketConnection(ChunkedWrites, UnixDomainSocketConnection):
    """A Unix socket connection with chunked writes."""


_CHUNKED: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: ChunkedConnection,
    SSLConnection: ChunkedSSLConnection,
    UnixDomainSocketConnection: ChunkedUnixDomainSocketConnection,
}


def chunked_writes(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """The chunked-writes form of one of redis-py's connection classes (any other class,
    or one already chunked, is returned as it is)."""
    return _CHUNKED.get(connection_class, connection_class)
