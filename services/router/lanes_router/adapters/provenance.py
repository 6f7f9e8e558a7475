"""Provenance off the request path: requests hand their `RequestServed` event to a queue, a task publishes.

The publishing task takes what has queued (up to a batch), publishes the batch concurrently and awaits the
JetStream acks together, so a request never waits on NATS. `Nats-Msg-Id` is the event id: a batch re-sent
after a lost ack is stored once. Shutdown flushes what is left.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable

import structlog
from nats.js import JetStreamContext
from nats.js.api import PubAck

from lanes_contract.codec import encode
from lanes_contract.events import RequestServed
from lanes_contract.streams import REQUESTS

log = structlog.get_logger(__name__)
ACK_TIMEOUT_S = 10.0
"""How long a batch waits for its JetStream acks before the unacknowledged events are sent again."""
_BUILD_SLICE = 16


class ProvenancePublisher:
    """A bounded in-memory queue of request events and the task that publishes them in batches."""

    def __init__(
        self, js: JetStreamContext, *, batch_size: int = 256, linger_s: float = 0.02, max_queued: int = 100_000
    ) -> None:
        self._js = js
        self._batch_size = batch_size
        self._linger_s = linger_s
        self._queue: deque[Callable[[], RequestServed]] = deque()
        self._max_queued = max_queued
        self._wake = asyncio.Event()
        self.published = 0
        self.dropped = 0
        self.failures = 0

    @property
    def queued(self) -> int:
        """Events waiting to be published."""
        return len(self._queue)

    def submit(self, build: Callable[[], RequestServed]) -> None:
        """Queue one event, as the function that builds it (built off the request's path); never blocks.

        When the queue is full the oldest event is dropped, counted and logged at the next batch.
        """
        if len(self._queue) >= self._max_queued:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append(build)
        if len(self._queue) >= self._batch_size:
            self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Publish batches until `stop` is set, then publish everything still queued."""
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                woken = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({woken, stopping}, timeout=self._linger_s, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                self._wake.clear()
                while self._queue and not await self._publish_batch():
                    await asyncio.wait({stopping}, timeout=0.5)  # NATS is away: keep the events, try again
                    if stop.is_set():
                        break
        finally:
            stopping.cancel()
            await self.flush()

    async def flush(self, *, attempts: int = 5) -> None:
        """Publish everything queued now (a few tries); what still fails is logged with its count."""
        for _ in range(attempts):
            while self._queue:
                if not await self._publish_batch():
                    break
            if not self._queue:
                return
            await asyncio.sleep(0.2)
        log.error("provenance events not published at shutdown", events=len(self._queue))

    async def _publish_batch(self) -> bool:
        batch: list[RequestServed] = []
        for built in range(min(self._batch_size, len(self._queue))):
            build = self._queue.popleft()
            try:
                batch.append(build())
            except ValueError as exc:  # a bug, not an outage: say so and keep the others
                log.exception("provenance event could not be built", error=str(exc))
            if built % _BUILD_SLICE == _BUILD_SLICE - 1:
                await asyncio.sleep(0)  # let requests run between slices: a batch must not stall the loop
        acks: list[asyncio.Future[PubAck]] = []
        try:
            for event in batch:
                encoded = encode(event, revalidate=False)  # built by its validating constructor
                acks.append(
                    await self._js.publish_async(
                        encoded.subject, encoded.payload, headers=encoded.headers, stream=REQUESTS.name
                    )
                )
        except Exception as exc:  # noqa: BLE001 - the connection is down: keep what was not sent
            log.warning("provenance publish failed; will retry", error=str(exc) or type(exc).__name__)
        done, pending = await asyncio.wait(acks, timeout=ACK_TIMEOUT_S) if acks else (set(), set())
        for future in pending:
            future.cancel()
        stored = {id(f) for f in done if not f.cancelled() and f.exception() is None}
        failed = [event for event, ack in zip(batch, acks, strict=False) if id(ack) not in stored]
        failed += batch[len(acks) :]
        self.published += len(batch) - len(failed)
        if not failed:
            return True
        self.failures += len(failed)
        log.warning("provenance events not acknowledged; will retry", events=len(failed))
        # Re-sent with the same ids: JetStream drops the ones that were stored after all.
        self._queue.extendleft(functools.partial(_same, event) for event in reversed(failed))
        return False


def _same(event: RequestServed) -> RequestServed:
    return event
