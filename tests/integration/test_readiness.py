"""Readiness that tells the truth, on real servers (issue 43): a frozen PostgreSQL, and what it leaves behind.

A frozen PostgreSQL (every process stopped with SIGSTOP) turns the consumers that use it not ready within
5 s, their `lanes_consumer_ready` gauges with them, and ready again once it is resumed, with nothing lost or
done twice. An outage is logged once when it starts and once when it ends, not once per retry. (Ready from
the start, not ready for good after a failure, and a slow batch being no outage: test_consumer_contract.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import REGISTRY
from support.contract import EFFECTS_DDL, effects, record_effect, spec_for, submission
from support.freezing import frozen
from support.logs import JsonLogs, json_logs
from support.restartable_nats import RestartableNats
from support.waiting import eventually

from lanes_audit.adapters.signing import Signer
from lanes_audit.entrypoints.recorder import AuditRecorder
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.streams import DEAD, JOBS, provision_streams
from lanes_runtime.consumer import EventConsumer, Outcome
from lanes_runtime.health import PROBE_EVERY_S, DatabaseWatch, Readiness
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_migrations, apply_runtime_migrations, create_pool, migrations_of
from lanes_sandbox.embedded import EmbeddedPostgres
from lanes_telemetry.entrypoints.timers import SettleTimers

pytestmark = pytest.mark.real_servers

NOT_READY_WITHIN_S = 5.0
"""What the issue asks: a frozen database turns a consumer not ready within this."""
BUSY_MACHINE_MARGIN_S = 5.0
"""Added to that wait: a 2-core machine shared with other tests is slow, never wrong."""


@pytest.fixture
def logs(capsys: pytest.CaptureFixture[str]) -> Iterator[JsonLogs]:
    with json_logs(capsys) as captured:
        yield captured


def _ready_gauge(consumer: str) -> float | None:
    return REGISTRY.get_sample_value("lanes_consumer_ready", {"consumer": consumer})


@pytest.mark.slow
async def test_a_frozen_database_turns_consumers_not_ready_within_5s_and_ready_after_thaw_losing_nothing(
    own_urls: ServerUrls, unique: str, logs: JsonLogs
) -> None:
    with EmbeddedPostgres() as postgres:
        db = await create_pool(postgres.url)
        await apply_runtime_migrations(db)
        await apply_migrations(db, "audit", migrations_of("lanes_audit.adapters"))
        await db.execute(EFFECTS_DDL)
        lanes = await LanesClient.connect(own_urls.nats_url, source="tests")
        await provision_streams(lanes.js)
        job_id = f"frozen-{unique}"
        consumer = EventConsumer(lanes._nc, db, spec_for(job_id, ack_wait_s=30.0), record_effect)
        recorder = AuditRecorder(lanes._nc, db, signer=Signer(Ed25519PrivateKey.generate()), durable=f"audit-{unique}")
        stop = asyncio.Event()
        running = [asyncio.create_task(consumer.run(stop)), asyncio.create_task(recorder.run(stop))]

        async def all_ready(*, ready: bool) -> bool:
            return all(
                runner.ready is ready and _ready_gauge(runner.name) == float(ready) for runner in (consumer, recorder)
            )

        async def recorded_all() -> bool:
            last = (await lanes.js.stream_info(JOBS.name)).state.last_seq
            return bool(await db.fetchval("SELECT coalesce(max(seq), 0) >= $1 FROM audit_links", last))

        before = [submission(job_id) for _ in range(3)]
        for event in before:
            await lanes.publish(event)
        await eventually(lambda: _processed(consumer, 3), what="the first events processed")
        await eventually(recorded_all, what="the first events recorded")
        assert await all_ready(ready=True)

        during = [submission(job_id) for _ in range(3)]
        with frozen(postgres):
            for event in during:  # the bus still takes them: their batch waits on the frozen database
                await lanes.publish(event)
            await eventually(
                lambda: all_ready(ready=False),
                timeout_s=NOT_READY_WITHIN_S + BUSY_MACHINE_MARGIN_S,
                what="both consumers not ready with the database frozen",
            )
        await eventually(lambda: all_ready(ready=True), timeout_s=60, what="both consumers ready after the thaw")
        await eventually(lambda: _processed(consumer, 6), timeout_s=60, what="every event processed")
        await eventually(recorded_all, timeout_s=60, what="every event recorded")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*running), timeout=30)

        assert [await effects(db, event.id) for event in before + during] == [1] * 6  # nothing lost, none twice
        assert consumer.outcomes[Outcome.DEAD_LETTERED] == 0
        assert (await lanes.js.stream_info(DEAD.name)).state.messages == 0
        last = (await lanes.js.stream_info(JOBS.name)).state.last_seq
        assert await db.fetchval("SELECT count(*) FROM audit_links") == last  # every message once, in the chain
        logs.assert_one_outage(consumer.name)
        logs.assert_one_outage(recorder.name)
        await lanes.close()
        await db.close()


@pytest.mark.slow
async def test_a_stopped_bus_turns_an_idle_consumer_not_ready_and_ready_again_once_it_is_back(
    urls: ServerUrls, tmp_path: Path, unique: str, logs: JsonLogs
) -> None:
    db = await create_pool(urls.database_url)
    await apply_runtime_migrations(db)
    await db.execute(EFFECTS_DDL)
    with RestartableNats(tmp_path / "nats") as nats:
        nc = await connect_nats(nats.url, name="readiness-tests")
        await provision_streams(nc.jetstream())
        job_id = f"bus-{unique}"
        consumer = EventConsumer(nc, db, spec_for(job_id), record_effect)
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))

        async def ready(*, ready: bool) -> bool:
            return consumer.ready is ready and _ready_gauge(consumer.name) == float(ready)

        async def subscribed() -> bool:  # its durable exists: the loop is past start-up
            return consumer.name in [info.name for info in await nc.jetstream().consumers_info(JOBS.name)]

        await eventually(subscribed, what="the consumer running")
        nats.stop()  # the process ends: the consumer's pull requests go unanswered
        await eventually(lambda: ready(ready=False), timeout_s=10 + BUSY_MACHINE_MARGIN_S, what="not ready")
        nats.start()
        await eventually(lambda: ready(ready=True), timeout_s=60, what="ready once the bus is back")
        event = submission(job_id)
        await LanesClient(nc, "tests").publish(event)
        await eventually(lambda: _processed(consumer, 1), timeout_s=60, what="an event after the outage processed")
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        await nc.close()
    assert await effects(db, event.id) == 1
    await db.close()
    logs.assert_one_outage(consumer.name)


async def _processed(consumer: EventConsumer, count: int) -> bool:
    return consumer.outcomes[Outcome.PROCESSED] >= count


class _CountedSettleTimers(SettleTimers):
    """The telemetry settle timers, counting how their ticks ended (what the test waits on)."""

    failed = 0
    succeeded = 0

    async def tick(self) -> int:
        try:
            due = await super().tick()
        except Exception:
            self.failed += 1
            raise
        self.succeeded += 1
        return due


@pytest.mark.slow
async def test_a_timer_runner_logs_a_database_outage_once_not_a_traceback_per_tick(
    own_urls: ServerUrls, logs: JsonLogs
) -> None:
    with EmbeddedPostgres() as postgres:
        # Statements time out after 1 s (the services' pool: 30 s), so ticks fail again and again within a
        # short freeze. Two connections open before the freeze: each failing tick takes one.
        db = await asyncpg.create_pool(postgres.url, min_size=2, max_size=4, command_timeout=1)
        await apply_migrations(db, "telemetry", migrations_of("lanes_telemetry.adapters"))
        nc = await connect_nats(own_urls.nats_url, name="readiness-tests")
        timers = _CountedSettleTimers(nc, db, tick_s=0.1)
        stop = asyncio.Event()
        task = asyncio.create_task(timers.run(stop))
        await eventually(lambda: _at_least(timers.succeeded, 1), what="a tick before the freeze")
        with frozen(postgres):
            await eventually(lambda: _at_least(timers.failed, 2), timeout_s=30, what="two failed ticks")
        after_thaw = timers.succeeded
        await eventually(lambda: _at_least(timers.succeeded, after_thaw + 1), timeout_s=90, what="a tick after it")
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        logs.assert_one_outage(timers.name)
        await nc.close()
        await db.close()


async def _at_least(value: int, least: int) -> bool:
    return value >= least


async def test_a_pool_that_takes_the_probes_connection_back_leaves_the_consumer_not_ready_not_dead(
    own_urls: ServerUrls,
) -> None:
    # The database probe holds one connection between probes. A pool that takes it back under the probe
    # (terminated, as at shutdown, or a connection that broke) made asyncpg refuse the probe's own clean-up,
    # and that refusal ended the consumer that was watching: `lanes serve` exited on an ExceptionGroup.
    pool = await asyncpg.create_pool(own_urls.database_url, min_size=1, max_size=2)
    readiness = Readiness("probe-taken-back")
    async with DatabaseWatch.watching(pool, readiness):
        await eventually(lambda: _probed(readiness), what="a first probe")
        pool.terminate()
        await eventually(lambda: _not_ready(readiness), what="the probe to find the pool gone")
    assert not readiness.ready  # left as it was: waiting on the database, not failed


async def _probed(readiness: Readiness) -> bool:
    await asyncio.sleep(PROBE_EVERY_S)
    return readiness.ready


async def _not_ready(readiness: Readiness) -> bool:
    return not readiness.ready
