"""The timer runner: fires recovery's due timers (a finding's grace, a retry's backoff, a manual deadline).

Each due job is claimed with `FOR UPDATE SKIP LOCKED`, its timers fire inside that transaction, and the
events they produce go into the outbox under this runner's name, published after commit. So with two
recovery processes each timer fires once, and a crash between commit and publish is healed at the next
tick, which publishes what the outbox still holds (same ids: JetStream keeps one copy).
"""

from __future__ import annotations

import asyncio

import asyncpg
from nats.aio.client import Client as NatsClient

from lanes_contract.client import publish_encoded
from lanes_contract.codec import EncodedEvent
from lanes_recovery.adapters import repository
from lanes_recovery.service_layer.handlers import Recovery
from lanes_runtime.health import tick_until_stopped

TIMERS = "recovery-timers"


class RecoveryTimers:
    """Polls PostgreSQL for due recovery timers and fires them."""

    def __init__(self, nc: NatsClient, pool: asyncpg.Pool, recovery: Recovery, *, tick_s: float = 0.5) -> None:
        self._js = nc.jetstream()
        self._pool = pool
        self._recovery = recovery
        self._tick_s = tick_s

    @property
    def name(self) -> str:
        """The outbox name of the runner's events."""
        return TIMERS

    async def provision(self) -> None:
        """Load and validate the policy now, so a bad policy file stops the service at start-up."""
        _ = self._recovery.policy

    async def run(self, stop: asyncio.Event) -> None:
        """Fire due timers every tick until `stop` is set; a failed tick is redone at the next one.

        Nothing is lost. A database outage is logged once when it starts and once when it ends.
        """
        await tick_until_stopped(self.name, self.tick, stop, every_s=self._tick_s)

    async def tick(self) -> int:
        """Publish what the outbox holds, then fire every due timer; return how many events were published."""
        published = await self._flush()
        now = self._recovery.now()
        for job_id in await repository.due_jobs(self._pool, now):
            async with self._pool.acquire() as conn, conn.transaction():
                outputs = await self._recovery.on_timer(conn, job_id, now)
                if outputs:
                    await repository.add_to_outbox(conn, TIMERS, job_id, outputs)
            if outputs:
                published += await self._flush()
        return published

    async def _flush(self) -> int:
        rows = await repository.outbox_rows(self._pool, TIMERS)
        for row_id, subject, headers, stream, payload in rows:
            await publish_encoded(self._js, EncodedEvent(subject, headers, payload), stream=stream)
            await repository.drop_outbox_row(self._pool, row_id)
        return len(rows)
