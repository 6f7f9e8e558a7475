"""Connection hygiene in front of the HTTP server: a cap on open connections and a deadline for a request head.

aiohttp closes a connection idle between requests (its keep-alive timeout, which the runner sets to the
router's idle timeout) but waits for ever on a new connection that sent half a request head, so 800 such
connections (the slow-header flood) would hold 800 sockets of the router. Here a connection must send its
first complete head (up to the blank line) within `header_timeout_s`, and past `max_connections` a new
connection gets a 503 with Retry-After and is closed at once, so the router keeps answering the ones it has.
Later heads on a kept-alive connection are bounded by the keep-alive timeout only while it is idle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

_HEAD_END = b"\r\n\r\n"
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 26\r\nConnection: close\r\n\r\ntoo many open connections\n"
)


@dataclass
class GuardStats:
    """What the guard did (for metrics and tests)."""

    open: int = 0
    refused_full: int = 0
    closed_slow_header: int = 0


class ConnectionGuard:
    """A protocol factory wrapping the HTTP server's: counts connections and times request heads."""

    def __init__(
        self, factory: Callable[[], asyncio.Protocol], *, max_connections: int, header_timeout_s: float
    ) -> None:
        self._factory = factory
        self._max_connections = max_connections
        self._header_timeout_s = header_timeout_s
        self.stats = GuardStats()

    def __call__(self) -> asyncio.Protocol:
        """A protocol for one new connection."""
        if self.stats.open >= self._max_connections:
            return _Refuse(self.stats)
        return _Guarded(self, self._factory())

    @property
    def header_timeout_s(self) -> float:
        """How long a connection may take to send one request head."""
        return self._header_timeout_s


class _Refuse(asyncio.Protocol):
    def __init__(self, stats: GuardStats) -> None:
        self._stats = stats

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._stats.refused_full += 1
        cast("asyncio.Transport", transport).write(_FULL)
        transport.close()


class _Guarded(asyncio.Protocol):
    """Forwards everything to the HTTP protocol; closes the connection when a head is late."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._in_head = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast("asyncio.Transport", transport)
        self._guard.stats.open += 1
        self._arm()
        self._inner.connection_made(transport)

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.header_timeout_s, self._late)

    def _late(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._guard.stats.closed_slow_header += 1
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        self._watch(data)
        self._inner.data_received(data)

    def _watch(self, data: bytes) -> None:
        if not self._in_head:
            return
        seen = self._tail + data
        if _HEAD_END in seen:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._in_head = False
            self._tail = b""
        else:
            self._tail = seen[-(len(_HEAD_END) - 1) :]

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._guard.stats.open -= 1
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
