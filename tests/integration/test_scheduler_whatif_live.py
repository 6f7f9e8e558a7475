"""The scheduler what-if over a log the real scheduler wrote (NATS + PostgreSQL): every decision reproduced.

The scheduler service (as `lanes up` runs it, on a NATS server of the test's own) places, holds back and
releases a few gangs on two nodes; the test then reads its node and job streams back, as `lanes replay` would
give them, and `replay_scheduler` with the log's own cluster must give every recorded `job_placed` the same
GPUs and every `job_waiting` the same reason, in order.
"""

from __future__ import annotations

import pytest
from nats.js import JetStreamContext
from support.cli import local_stack
from support.recovery import register_nodes
from support.waiting import eventually

from lanes_contract.client import LanesClient
from lanes_contract.codec import decode
from lanes_contract.events import (
    Event,
    JobPlaced,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    JobWaiting,
)
from lanes_contract.jobs import JobSpec, JobState
from lanes_contract.streams import JOBS, NODES
from lanes_runtime.settings import ServerUrls
from lanes_scheduler.views import replay_scheduler

pytestmark = pytest.mark.real_servers


async def _stream(js: JetStreamContext, stream: str) -> list[Event]:
    """Every event of a stream, in stream order."""
    info = await js.stream_info(stream)
    sub = await js.subscribe(">", stream=stream, ordered_consumer=True)
    events: list[Event] = []
    try:
        while len(events) < info.state.messages:
            msg = await sub.next_msg(timeout=5)
            events.append(decode(msg.subject, msg.headers, msg.data))
    finally:
        await sub.unsubscribe()
    return events


async def _log(js: JetStreamContext) -> list[Event]:
    return sorted([*await _stream(js, NODES.name), *await _stream(js, JOBS.name)], key=lambda e: e.time)


async def _decided(js: JetStreamContext, job_id: str, kind: type[Event]) -> bool:
    return any(isinstance(e, kind) and e.jobid == job_id for e in await _stream(js, JOBS.name))


async def test_the_replay_of_a_live_schedulers_log_reproduces_every_decision(own_urls: ServerUrls) -> None:
    async with local_stack(own_urls, ["scheduler"], nodes=False, agent=False) as conns:
        client = LanesClient(conns.nc, "tests")
        js = conns.nc.jetstream()
        await register_nodes(conns, client, ["n1", "n2"], gpus=8)

        async def submit(job_id: str, workers: int, gpus: int, then: type[Event]) -> None:
            spec = JobSpec(name=job_id, workers=workers, gpus_per_worker=gpus)
            await client.publish(JobSubmitted(source="tests", jobid=job_id, data=JobSubmittedData(spec=spec)))
            await eventually(lambda: _decided(js, job_id, then), what=f"{job_id}: {then.name}")

        async def finish(job_id: str) -> None:
            data = JobStateChangedData(from_state=JobState.RUNNING, to_state=JobState.SUCCEEDED, cause_type="tests")
            await client.publish(JobStateChanged(source="tests", jobid=job_id, attempt=1, data=data))

        await submit("wide", 2, 8, JobPlaced)
        await submit("next", 1, 8, JobWaiting)
        await submit("small", 1, 4, JobWaiting)
        await finish("wide")
        await eventually(lambda: _decided(js, "small", JobPlaced), what="small placed once wide ended")
        await eventually(lambda: _decided(js, "next", JobPlaced), what="next placed once wide ended")
        await finish("next")
        await finish("small")
        log = await _log(js)

    result = (await replay_scheduler(log)).as_json()

    assert result["replay_check"]["differences"] == []
    assert result["replay_check"]["recorded"] == 3
    assert result["replay_check"]["reproduced"] == 3
    assert result["wait_reasons"]["old"] == {"capacity_short": 2}
    assert result["double_booked"] == {"old": 0, "new": 0}
