"""The composition root: the one place where services meet concrete servers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import asyncpg
import redis.asyncio as aioredis
import structlog
from nats.aio.client import Client as NatsClient

from lanes_audit.entrypoints.service import SERVICE as AUDIT
from lanes_common.bus import connect_nats
from lanes_common.cache import connect_redis
from lanes_common.consumer import EventConsumer
from lanes_common.service import Runner, RunnerContext, ServiceDefinition
from lanes_common.settings import ServerUrls
from lanes_common.store import apply_migrations, create_pool, migrations_of
from lanes_common.streams import provision_streams
from lanes_lifecycle.entrypoints.service import SERVICE as LIFECYCLE
from lanes_recovery.entrypoints.service import SERVICE as RECOVERY
from lanes_router.entrypoints.service import SERVICE as ROUTER
from lanes_scheduler.entrypoints.service import SERVICE as SCHEDULER
from lanes_telemetry.entrypoints.service import SERVICE as TELEMETRY

SERVICES: dict[str, ServiceDefinition] = {s.name: s for s in (SCHEDULER, LIFECYCLE, TELEMETRY, RECOVERY, ROUTER, AUDIT)}
log = structlog.get_logger(__name__)


@dataclass
class Connections:
    """Open, checked connections to the three servers, with streams provisioned and migrations applied."""

    nc: NatsClient
    pool: asyncpg.Pool
    redis: aioredis.Redis


@contextlib.asynccontextmanager
async def connected(urls: ServerUrls, *, name: str, stream_replicas: int = 1) -> AsyncIterator[Connections]:
    """Connect to all three servers, provision the streams and the shared tables, and close on exit."""
    nc = await connect_nats(urls.nats_url, name=name)
    try:
        await provision_streams(nc.jetstream(), replicas=stream_replicas)
        pool = await create_pool(urls.database_url, max_size=20)
        try:
            await apply_migrations(pool, "lanes_common", migrations_of("lanes_common"))
            redis = await connect_redis(urls.redis_url)
            try:
                yield Connections(nc, pool, redis)
            finally:
                await redis.aclose()
        finally:
            await pool.close()
    finally:
        # close, not drain: every publish already waited for its JetStream ack, and draining pull
        # subscriptions waits out their pending fetches (up to the drain timeout) for nothing.
        with contextlib.suppress(Exception):
            await nc.close()


async def prepare_services(conns: Connections, services: Iterable[str | ServiceDefinition]) -> list[Runner]:
    """Apply each service's migrations and provision its consumers; return the consumers, not yet running.

    A service is named (one of `SERVICES`) or given as a definition (e.g. recovery under a test's policy).
    """
    consumers: list[Runner] = []
    for named in services:
        service = SERVICES[named] if isinstance(named, str) else named
        if service.migrations is not None:
            await apply_migrations(conns.pool, service.name, service.migrations)
        for spec, handler in service.consumers:
            consumer = EventConsumer(conns.nc, conns.pool, spec, handler)
            await consumer.provision()
            consumers.append(consumer)
        for make in service.runners:
            runner = make(RunnerContext(conns.nc, conns.pool, conns.redis))
            await runner.provision()
            consumers.append(runner)
    return consumers


async def run_consumers(consumers: Iterable[Runner], stop: asyncio.Event) -> None:
    """Run consumers until `stop` is set; if one fails, the others are cancelled and the error raised."""
    log.info("consumers running", consumers=[c.name for c in consumers])
    async with asyncio.TaskGroup() as group:
        for consumer in consumers:
            group.create_task(consumer.run(stop), name=consumer.name)
