"""What a stream really stores: each event counted by its id, so a test sees an event stored twice."""

from __future__ import annotations

from collections import Counter

from nats.js import JetStreamContext

from lanes_contract.codec import decode
from lanes_contract.streams import JOBS
from lanes_runtime.reader import Selection, iter_stream


async def job_events_stored(js: JetStreamContext, job_id: str) -> Counter[tuple[str, str]]:
    """How many times LANES_JOBS stores each of the job's events, by (event name, event id)."""
    stored: Counter[tuple[str, str]] = Counter()
    async for msg in iter_stream(js, Selection(JOBS.name, f"lanes.job.{job_id}.>")):
        stored[msg.subject.rsplit(".", 1)[1], decode(msg.subject, msg.headers, msg.data).id] += 1
    return stored
