"""A test handler with a visible effect, shared by the contract tests and their crashing child process."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg
from nats.js import JetStreamContext

from lanes_contract.events import Event, JobSubmitted, JobSubmittedData, JobWaiting, JobWaitingData, derive
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS
from lanes_runtime.consumer import ConsumerSpec, HandlerContext
from lanes_runtime.store import Db

EFFECTS_DDL = "CREATE TABLE IF NOT EXISTS effects (id bigserial PRIMARY KEY, event_id text NOT NULL)"


def spec_for(job_id: str, **overrides: object) -> ConsumerSpec:
    """A consumer of one job's submissions, with short timings so redeliveries happen within a test."""
    fields: dict[str, object] = {
        "durable": f"test-{job_id}",
        "stream": JOBS,
        "subjects": (f"lanes.job.{job_id}.submitted",),
        "ack_wait_s": 2.0,
        "max_deliver": 4,
        "redelivery_delays_s": (0.2,),
    }
    return ConsumerSpec(**(fields | overrides))  # type: ignore[arg-type]


def submission(job_id: str) -> JobSubmitted:
    """A valid input event for `job_id`."""
    return JobSubmitted(
        source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=JobSpec(name="t", workers=1))
    )


async def record_effect(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """Insert one row per processing and emit one follow-up event."""
    await ctx.conn.execute("INSERT INTO effects (event_id) VALUES ($1)", event.id)
    return [derive(JobWaiting, event, source="tests", data=JobWaitingData(reason="seen"))]


async def effects(conn: Db | asyncpg.Pool, event_id: str) -> int:
    """How many times the handler's effect was committed for an event."""
    count = await conn.fetchval("SELECT count(*) FROM effects WHERE event_id = $1", event_id)
    return int(count)


async def stored(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages a stream holds on a subject."""
    info = await js.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))
