"""Readiness that tells the truth: a loop is ready from its start until it fails or a server it needs is away.

`Readiness` is the one place a loop's readiness changes: its `ready` and its `lanes_consumer_ready` gauge are
set there together, from the same state. It also logs the loop's outages: one warning when the first cause
finds a server unavailable, one line when the last of them answers again, however many retries happen in
between (a traceback per retry says nothing the first warning did not).

A batch waiting on a frozen PostgreSQL only fails when its statement times out (the pool's command timeout,
30 s), and an idle loop runs no statement at all, so neither says soon that the database is gone.
`DatabaseWatch` asks `SELECT 1` every PROBE_EVERY_S on a connection of its own, with PROBE_TIMEOUT_S to
answer: a frozen server turns every loop watching it not ready within about PROBE_EVERY_S + PROBE_TIMEOUT_S.
The probe never touches a batch's transaction. A big batch whose commit is slow but healthy goes on (the
server still answers a `SELECT 1` on another connection meanwhile, so it is not taken for an outage), and a
batch stuck on a frozen server is held and retried as before: nothing is abandoned, so nothing is lost or
done twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterator
from typing import TYPE_CHECKING, ClassVar

import asyncpg
import structlog

from lanes_runtime.failures import is_infrastructure

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy
    from prometheus_client import Gauge


def _log() -> structlog.typing.FilteringBoundLogger:
    """This module's logger, looked up at each (rare) outage line rather than once at import.

    A logger used once is cached with the configuration of that moment, and a process may configure logging
    more than once: every in-process `lanes` command does, a quiet one at level error.
    """
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(__name__)
    return logger


PROBE_EVERY_S = 1.0
"""Pause between two database probes."""
PROBE_TIMEOUT_S = 2.5
"""How long a `SELECT 1` may take: a server that cannot answer it in this time is not serving anyone. Not
shorter: a busy machine (or a busy event loop in this process) must not pass for an outage, and with
PROBE_EVERY_S a frozen server is still seen within 3.5 s."""
DATABASE = "database"
"""The cause `DatabaseWatch` reports under."""


def describe(exc: BaseException) -> str:
    """`Type: message`, or the type alone when the message is empty (a bare TimeoutError)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Readiness:
    """Whether a loop is ready: not failed, and no cause (a held batch, a fetch, the probe) waiting on a server."""

    def __init__(self, name: str, gauge: Gauge | None = None) -> None:
        self._name = name
        self._gauge = gauge
        self._waiting: dict[Hashable, str] = {}
        """Each cause that found a server unavailable, with the last error it saw."""
        self._failure: str | None = None
        self._outage_began: float | None = None
        self._retries = 0
        self._show()

    @property
    def ready(self) -> bool:
        """True from the start, False while any cause waits on a server or once the loop failed."""
        return not self._waiting and self._failure is None

    def unavailable(self, cause: Hashable, error: str) -> None:
        """`cause` found a server unavailable (and will try again): not ready until it answers."""
        if self._outage_began is None:
            self._outage_began = time.monotonic()
            _log().warning("server unavailable; holding until it answers", consumer=self._name, error=error)
        self._retries += 1
        self._waiting[cause] = error
        self._show()

    def answered(self, cause: Hashable) -> None:
        """`cause` got its answer: once no cause waits any more, the outage is over."""
        if self._waiting.pop(cause, None) is None or self._waiting:
            return
        assert self._outage_began is not None  # noqa: S101 - set with the first waiting cause
        _log().info(
            "servers answer again; resuming",
            consumer=self._name,
            outage_s=round(time.monotonic() - self._outage_began, 1),
            retries=self._retries,
        )
        self._outage_began, self._retries = None, 0
        self._show()

    def failed(self, error: str) -> None:
        """The loop stopped on an error: not ready for good."""
        self._failure = error
        self._show()

    @contextlib.contextmanager
    def failing_for_good(self) -> Iterator[None]:
        """Around a loop's run: an error that ends it makes it not ready for good (and is raised on)."""
        try:
            yield
        except Exception as exc:
            self.failed(describe(exc))
            raise

    def _show(self) -> None:
        if self._gauge is not None:
            self._gauge.set(1 if self.ready else 0)


class DatabaseWatch:
    """A `SELECT 1` every PROBE_EVERY_S through one pool, its verdict given to every loop watching it.

    One per pool, shared by the loops of a process, so a process holds one probe connection, not one per
    consumer. The connection is kept between probes: a pool busy with healthy work does not delay the probe
    (a probe that waited for a connection could take a busy pool for a dead server).
    """

    _of_pool: ClassVar[dict[asyncpg.Pool, DatabaseWatch]] = {}

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._watchers: list[Readiness] = []
        self._task: asyncio.Task[None] | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def watching(cls, pool: asyncpg.Pool, readiness: Readiness) -> AsyncIterator[None]:
        """Within the block, `readiness` hears the database probe of `pool` (started with its first watcher)."""
        watch = cls._of_pool.get(pool)
        if watch is None:
            watch = cls._of_pool[pool] = cls(pool)
        watch._watchers.append(readiness)
        if watch._task is None:
            watch._task = asyncio.create_task(watch._probe_forever(), name="lanes-database-probe")
        try:
            yield
        finally:
            watch._watchers.remove(readiness)
            if not watch._watchers:
                del cls._of_pool[pool]
                watch._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch._task

    async def _probe_forever(self) -> None:
        conn: PoolConnectionProxy[asyncpg.Record] | None = None
        try:
            while True:
                try:
                    async with asyncio.timeout(PROBE_TIMEOUT_S):
                        if conn is None:
                            conn = await self._pool.acquire()
                        await conn.fetchval("SELECT 1")
                except Exception as exc:  # noqa: BLE001 - whatever stops a SELECT 1 means the server does not serve
                    error = (
                        f"PostgreSQL did not answer SELECT 1 within {PROBE_TIMEOUT_S:g} s"
                        if isinstance(exc, TimeoutError)
                        else describe(exc)
                    )
                    for readiness in tuple(self._watchers):
                        readiness.unavailable(DATABASE, error)
                    if conn is not None:
                        # Its query may still be waiting on the server: closed without a round trip, the pool
                        # opens a new one at the next probe.
                        dropped, conn = conn, None
                        await self._drop(dropped)
                else:
                    for readiness in tuple(self._watchers):
                        readiness.answered(DATABASE)
                await asyncio.sleep(PROBE_EVERY_S)
        finally:
            if conn is not None:
                await self._drop(conn)

    async def _drop(self, conn: PoolConnectionProxy[asyncpg.Record]) -> None:
        """Close the probe's connection without a round trip (the server may be the one not answering).

        The caller forgets `conn` first: the pool takes it back at once, even if this await is cancelled. A
        connection the pool already took back (the pool closed or terminated, the connection broke) has nothing
        left to drop: asyncpg refuses both calls then, and that refusal must not end the consumer watching.
        """
        with contextlib.suppress(asyncpg.InterfaceError):
            conn.terminate()
        with contextlib.suppress(asyncpg.InterfaceError):
            await self._pool.release(conn)


async def tick_until_stopped(
    name: str, tick: Callable[[], Awaitable[object]], stop: asyncio.Event, *, every_s: float
) -> None:
    """Run `tick` every `every_s` until `stop` is set (a timer runner); a tick that failed is tried at the next.

    A server that does not answer is an outage: logged once when it starts and once when it ends, however
    many ticks fail in between. Any other failure is a bug, logged with its traceback each time.
    """
    servers = Readiness(name)
    while not stop.is_set():
        try:
            await tick()
        except Exception as exc:  # noqa: BLE001 - a failed tick is tried at the next; a bug is logged with its traceback
            if not is_infrastructure(exc):
                _log().exception("tick failed; retrying", runner=name)
            else:
                servers.unavailable(_TICK, describe(exc))
        else:
            servers.answered(_TICK)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)


_TICK = "tick"
