"""`BatchPull` against a real JetStream: batches, waits, messages of a request no longer awaited, refusals."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from support.contract import submission
from support.waiting import eventually

from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.streams import JOBS
from lanes_runtime.delivery import BatchPull
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers


@pytest.fixture
async def nc(urls: ServerUrls) -> AsyncIterator[NatsClient]:
    client = await connect_nats(urls.nats_url, name="tests")
    yield client
    await client.close()


@contextlib.asynccontextmanager
async def _pulling(
    nc: NatsClient, lanes: LanesClient, unique: str, jobs: int, *, later: int = 0
) -> AsyncIterator[tuple[BatchPull, str, list[str]]]:
    """A BatchPull on a new durable of `jobs + later` jobs' submissions, the first `jobs` published already.

    Yields the puller, the durable's name and every job id (the ones not published yet last).
    """
    job_ids = [f"{unique}-{n}" for n in range(jobs + later)]
    for job_id in job_ids[:jobs]:
        await lanes.publish(submission(job_id))
    durable = f"pull-{unique}"
    config = ConsumerConfig(
        durable_name=durable,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        filter_subjects=[f"lanes.job.{job_id}.submitted" for job_id in job_ids],
    )
    await lanes.js.add_consumer(JOBS.name, config=config)
    pull = await BatchPull.bind(nc, JOBS.name, durable)
    try:
        yield pull, durable, job_ids
    finally:
        await pull.unsubscribe()


def _jobs_of(msgs: list[Msg]) -> list[str]:
    return [msg.subject.split(".")[2] for msg in msgs]


async def test_a_fetch_takes_what_is_there_up_to_its_batch_and_waits_only_when_nothing_is(
    nc: NatsClient, lanes: LanesClient, unique: str
) -> None:
    async with _pulling(nc, lanes, unique, 5, later=1) as (pull, _, [*job_ids, late_job]):
        first = await pull.fetch(3, 5.0)
        rest = await pull.fetch(10, 5.0)  # two are there: they come back without waiting for eight more
        assert _jobs_of(first) + _jobs_of(rest) == job_ids
        assert [msg.metadata.num_delivered for msg in first + rest] == [1] * 5
        for msg in first + rest:
            await msg.ack()
        assert await pull.fetch(10, 0.2) == []  # nothing there, nothing came: empty after the wait

        # A fetch that waits gets what is published meanwhile.
        waiting = asyncio.create_task(pull.fetch(10, 10.0))
        await lanes.publish(submission(late_job))
        arrived = await waiting
        assert _jobs_of(arrived) == [late_job]
        await arrived[0].ack()


async def test_messages_of_a_request_no_longer_awaited_are_returned_by_the_next_fetch_once(
    nc: NatsClient, lanes: LanesClient, unique: str
) -> None:
    async with _pulling(nc, lanes, unique, 3) as (pull, durable, job_ids):
        # A request whose fetch gave up waiting (the bus was away, say) may still be served afterwards. Sent
        # here by hand to the puller's inbox, as an earlier fetch's request would have been.
        await nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{JOBS.name}.{durable}",
            json.dumps({"batch": 3, "no_wait": True}).encode(),
            reply=f"{pull._inbox}.0",  # standing in for an earlier request of this puller
        )
        await eventually(lambda: _received(pull, len(job_ids)), what="the unawaited request served")
        kept = await pull.fetch(10, 5.0)
        assert _jobs_of(kept) == job_ids  # kept, in order, each on its first delivery
        assert [msg.metadata.num_delivered for msg in kept] == [1, 1, 1]
        for msg in kept:
            await msg.ack()
        assert await pull.fetch(10, 0.2) == []  # and returned once


async def _received(pull: BatchPull, count: int) -> bool:
    return len(pull._late) == count  # what the next fetch will return first


async def test_a_fetch_from_a_deleted_consumer_fails_with_the_server_s_status(
    nc: NatsClient, lanes: LanesClient, unique: str
) -> None:
    async with _pulling(nc, lanes, unique, 1) as (pull, durable, _):
        await lanes.js.delete_consumer(JOBS.name, durable)
        with pytest.raises(NatsError, match="pull request refused"):
            await pull.fetch(10, 5.0)
