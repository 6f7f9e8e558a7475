"""Durables that come back (issue 34, item 1): deleted or re-filtered by the admin mid-stream, a service's durable
consumer is restored where it was, every event is applied exactly once, and the consumer is not ready until
then. On real NATS JetStream and PostgreSQL servers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import asyncpg
import pytest
from nats.js.api import DeliverPolicy
from prometheus_client import Gauge
from support.contract import EFFECTS_DDL, record_effect, spec_for, submission
from support.logs import json_logs
from support.waiting import eventually

from lanes_contract.client import LanesClient
from lanes_contract.streams import JOBS
from lanes_runtime import upkeep
from lanes_runtime.consumer import ConsumerSpec, EventConsumer
from lanes_runtime.metrics import ConsumerMetrics
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_runtime_migrations, create_pool

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]

EVENTS_BEFORE, EVENTS_DURING, EVENTS_AFTER = 30, 30, 30


@pytest.fixture
async def pool(urls: ServerUrls) -> AsyncIterator[asyncpg.Pool]:
    db = await create_pool(urls.database_url)
    await apply_runtime_migrations(db)
    await db.execute(EFFECTS_DDL)
    yield db
    await db.close()


@pytest.fixture(autouse=True)
def quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked every half second: the same code path as every three, with a shorter wait."""
    monkeypatch.setattr(upkeep, "CHECK_EVERY_S", 0.5)


class ReadinessSeen(Gauge):
    """The consumer's readiness gauge, remembering every value it was set to (unregistered)."""

    def __init__(self) -> None:
        super().__init__("lanes_test_ready_seen", "readiness values seen", registry=None)
        self.values: list[float] = []

    def set(self, value: float) -> None:
        self.values.append(value)
        super().set(value)


class Running:
    """A consumer running in a task of its own, its readiness remembered."""

    def __init__(self, lanes: LanesClient, pool: asyncpg.Pool, spec: ConsumerSpec) -> None:
        self.readiness = ReadinessSeen()
        metrics = dataclasses.replace(ConsumerMetrics.for_consumer(spec.durable), ready=self.readiness)
        self.consumer = EventConsumer(lanes._nc, pool, spec, record_effect, metrics=metrics)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.consumer.provision()
        self.task = asyncio.create_task(self.consumer.run(self.stop))

    async def stopped(self) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, timeout=15)


async def publish(lanes: LanesClient, job_id: str, count: int) -> list[str]:
    """Publish `count` submissions of `job_id` (each its own event id), one at a time; their ids."""
    ids = []
    for _ in range(count):
        event = submission(job_id)
        await lanes.publish(event)
        ids.append(event.id)
        await asyncio.sleep(0)  # let the consumer take some while the stream goes on
    return ids


async def applied(pool: asyncpg.Pool, ids: list[str]) -> dict[str, int]:
    """How many times each event's effect was committed (events never applied are absent)."""
    rows = await pool.fetch(
        "SELECT event_id, count(*) AS n FROM effects WHERE event_id = ANY($1::text[]) GROUP BY event_id", ids
    )
    return {row["event_id"]: int(row["n"]) for row in rows}


async def all_applied(pool: asyncpg.Pool, ids: list[str]) -> bool:
    return len(await applied(pool, ids)) == len(ids)


async def assert_each_applied_once(pool: asyncpg.Pool, ids: list[str], running: Running) -> None:
    await eventually(lambda: all_applied(pool, ids), timeout_s=60, what="every event applied")

    async def ready() -> bool:
        return running.consumer.ready

    await eventually(ready, what="the consumer ready again")
    assert await applied(pool, ids) == dict.fromkeys(ids, 1)


@pytest.mark.parametrize("ordered", [False, True], ids=["batch", "ordered"])
async def test_a_durable_deleted_by_the_admin_mid_stream_is_recreated_and_no_event_is_lost_or_applied_twice(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str, capsys: pytest.CaptureFixture[str], *, ordered: bool
) -> None:
    job_id = f"upkeep-deleted-{unique}"
    spec = spec_for(job_id, ordered=ordered, ack_wait_s=5.0)
    with json_logs(capsys) as logs:
        running = Running(lanes, pool, spec)
        await running.start()
        ids = await publish(lanes, job_id, EVENTS_BEFORE)
        await eventually(lambda: _some_applied(pool, ids), what="the consumer under way")
        during = asyncio.ensure_future(publish(lanes, job_id, EVENTS_DURING))
        await lanes.js.delete_consumer(JOBS.name, spec.durable)  # the admin, mid-stream
        ids += await during

        async def not_ready() -> bool:
            return 0 in running.readiness.values

        await eventually(not_ready, what="the consumer not ready while its durable is gone")
        ids += await publish(lanes, job_id, EVENTS_AFTER)
        await assert_each_applied_once(pool, ids, running)
        await running.stopped()
        lines = [line for line in logs.about(spec.durable) if line["event"].startswith("durable consumer")]
    info = await lanes.js.consumer_info(JOBS.name, spec.durable)
    assert info.config.deliver_policy == DeliverPolicy.BY_START_SEQUENCE
    assert running.readiness.values[-1] == 1
    found = [line for line in lines if line["event"] == "durable consumer not as its spec says; restoring it"]
    did = [line for line in lines if line["event"] == "durable consumer restored"]
    assert [(line["level"], line["found"]) for line in found] == [("warning", "missing")], lines
    assert [line["did"].split(" ", 4)[:4] for line in did] == [["recreated", "from", "stream", "sequence"]], lines


async def test_a_durable_re_filtered_by_the_admin_is_restored_and_the_events_it_hid_are_applied(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id = f"upkeep-filtered-{unique}"
    spec = spec_for(job_id, ack_wait_s=5.0)
    with json_logs(capsys) as logs:
        running = Running(lanes, pool, spec)
        await running.start()
        ids = await publish(lanes, job_id, EVENTS_BEFORE)
        await eventually(lambda: all_applied(pool, ids), what="the events before applied")
        bent = dataclasses.replace(spec.config(), filter_subjects=[f"lanes.job.{job_id}.nothing"])
        await lanes.js.add_consumer(JOBS.name, config=bent)  # the admin re-filters it in place
        ids += await publish(lanes, job_id, EVENTS_DURING)
        await assert_each_applied_once(pool, ids, running)
        await running.stopped()
        lines = [line for line in logs.about(spec.durable) if line["event"].startswith("durable consumer")]
    info = await lanes.js.consumer_info(JOBS.name, spec.durable)
    assert info.config.filter_subjects == list(spec.subjects)
    assert 0 in running.readiness.values
    assert running.readiness.values[-1] == 1
    assert any(line.get("found", "").startswith("changed (filter_subjects") for line in lines), lines


async def test_a_changed_ack_wait_is_put_back_in_place_keeping_the_position(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    job_id = f"upkeep-ackwait-{unique}"
    spec = spec_for(job_id, ack_wait_s=5.0)
    running = Running(lanes, pool, spec)
    await running.start()
    ids = await publish(lanes, job_id, EVENTS_BEFORE)
    await eventually(lambda: all_applied(pool, ids), what="the events before applied")
    as_provisioned = await lanes.js.consumer_info(JOBS.name, spec.durable)
    assert not upkeep.drift_of(spec, as_provisioned, None)  # the server's defaults are no drift
    await lanes.js.add_consumer(JOBS.name, config=dataclasses.replace(spec.config(), ack_wait=600.0))

    async def restored() -> bool:
        info = await lanes.js.consumer_info(JOBS.name, spec.durable)
        return bool(info.config.ack_wait == spec.ack_wait_s)

    await eventually(restored, what="the ack wait put back")
    ids += await publish(lanes, job_id, EVENTS_AFTER)
    await assert_each_applied_once(pool, ids, running)
    await running.stopped()
    info = await lanes.js.consumer_info(JOBS.name, spec.durable)
    assert info.created == as_provisioned.created  # updated, not made again
    assert info.config.deliver_policy == DeliverPolicy.ALL


async def test_a_durable_deleted_while_its_service_was_away_starts_again_after_its_recorded_floor(
    lanes: LanesClient, pool: asyncpg.Pool, unique: str
) -> None:
    job_id = f"upkeep-away-{unique}"
    spec = spec_for(job_id, ack_wait_s=5.0)
    running = Running(lanes, pool, spec)
    await running.start()
    ids = await publish(lanes, job_id, EVENTS_BEFORE)
    await eventually(lambda: all_applied(pool, ids), what="the events before applied")
    await running.stopped()
    await running.consumer.provision()  # records the floor the durable reached
    floor = (await lanes.js.consumer_info(JOBS.name, spec.durable)).ack_floor
    assert floor is not None
    await lanes.js.delete_consumer(JOBS.name, spec.durable)
    ids += await publish(lanes, job_id, EVENTS_AFTER)

    again = Running(lanes, pool, spec)
    await again.start()
    await assert_each_applied_once(pool, ids, again)
    await again.stopped()
    info = await lanes.js.consumer_info(JOBS.name, spec.durable)
    assert info.config.opt_start_seq == floor.stream_seq + 1


async def _some_applied(pool: asyncpg.Pool, ids: list[str]) -> bool:
    return bool(await applied(pool, ids))
