"""One socket write per event-loop turn on a client connection, however many the app made.

uvicorn writes every ASGI message at once: a JSON answer is two writes (headers, body),
a streamed answer one per SSE chunk. Tokens that a worker sends together reach the
router in one read and leave it as one chunk each, each a send(2) on loopback, which
costs about as much as the rest of relaying the token. `CoalescingTransport` keeps what
is written during one turn of the event loop and writes it as one buffer at the start
of the next (`call_soon`): nothing waits for more data, so no latency is added, and the
SSE events themselves are unchanged (only how many share a TCP segment).

close() and write_eof() write what is buffered first; abort() drops it.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescingTransport:
    """Wraps an asyncio transport; everything but writing is delegated to it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._pending.append(bytes(data))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        self._scheduled = False
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
