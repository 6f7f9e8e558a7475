"""The settle timer: when a failed attempt's settle window has run out, say so on the log.

The window is a row (`telemetry_attempts.settle_due_at`), so a restart loses no timer. The timer only
publishes `settle_window_ended` (its id derives from the attempt, so JetStream keeps one copy however often
a tick re-sends it); telemetry's job consumer handles that event like any other fact, under the consumer
contract, and closes the window in the same transaction as the settled finding it publishes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta

import asyncpg
from nats.aio.client import Client as NatsClient

from lanes_contract.client import publish_encoded
from lanes_contract.codec import encode
from lanes_contract.events import SettleWindowEnded, SettleWindowEndedData, utc_now
from lanes_contract.ids import derived_event_id
from lanes_contract.streams import JOBS
from lanes_runtime.health import tick_until_stopped
from lanes_telemetry.adapters import repository

SOURCE = "lanes/telemetry"


def window_end(due: repository.DueWindow) -> SettleWindowEnded:
    """The event that closes one attempt's settle window (the same id every time)."""
    event_type = str(SettleWindowEnded.model_fields["type"].default)
    return SettleWindowEnded(
        id=derived_event_id(f"{due.job_id}/{due.attempt}", event_type, "settle"),
        source=SOURCE,
        jobid=due.job_id,
        attempt=due.attempt,
        time=due.ended_at + timedelta(seconds=due.window_s),
        data=SettleWindowEndedData(ended_at=due.ended_at, window_s=due.window_s),
    )


class SettleTimers:
    """Polls PostgreSQL for settle windows that ran out and publishes their end."""

    def __init__(
        self, nc: NatsClient, pool: asyncpg.Pool, *, tick_s: float = 0.25, clock: Callable[[], datetime] = utc_now
    ) -> None:
        self._js = nc.jetstream()
        self._pool = pool
        self._tick_s = tick_s
        self._clock = clock

    @property
    def name(self) -> str:
        """The runner's name, for logs."""
        return "telemetry-settle-timers"

    async def provision(self) -> None:
        """Nothing to create: the windows live in telemetry's tables."""

    async def run(self, stop: asyncio.Event) -> None:
        """Close due windows every tick until `stop` is set; a failed tick is tried again at the next one.

        The next tick re-sends: ids are derived, nothing is duplicated. A database outage is logged once when
        it starts and once when it ends.
        """
        await tick_until_stopped(self.name, self.tick, stop, every_s=self._tick_s)

    async def tick(self) -> int:
        """Publish the end of every due window; return how many."""
        due = await repository.due_windows(self._pool, self._clock())
        for window in due:
            await publish_encoded(self._js, encode(window_end(window)), stream=JOBS.name)
        return len(due)
