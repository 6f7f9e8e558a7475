"""Stand-ins for servers that Lanes must refuse: they speak just enough protocol to be judged."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def server_announcing(version: str) -> AsyncIterator[str]:
    """A TCP peer that speaks just enough of the NATS protocol to announce a server version."""

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "old", "version": version, "proto": 1, "max_payload": 1048576, "headers": True}
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                if line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
                    await writer.drain()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"nats://127.0.0.1:{port}"
