"""Reading the timeline back from JetStream, with an ephemeral consumer that leaves nothing behind."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from lanes_common.codec import decode, format_time
from lanes_common.errors import DecodeError
from lanes_common.events import Event
from lanes_common.streams import JOBS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError


@dataclass(frozen=True)
class TimelineEntry:
    """One stored event and its stream sequence, or the reason it could not be decoded."""

    seq: int
    subject: str
    event: Event | None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The row of `lanes demo --json` / `lanes timeline --json`."""
        if self.event is None:
            return {"seq": self.seq, "subject": self.subject, "type": None, "error": self.error}
        e = self.event
        return {
            "seq": self.seq,
            "time": format_time(e.time),
            "type": e.type,
            "lane": e.lane.value,
            "job_id": e.jobid,
            "attempt": e.attempt,
            "node": e.node,
            "rank": e.rank,
            "source": e.source,
            "data": e.model_dump(mode="json")["data"],
        }


async def read_stream(js: JetStreamContext, stream: str, subject: str, *, batch: int = 512) -> list[TimelineEntry]:
    """Every stored message on `subject` (wildcards allowed) in stream order, read once, read-only."""
    try:
        info = await js.stream_info(stream, subjects_filter=subject)
    except NotFoundError:
        return []  # no stream yet: nothing was ever published there
    expected = sum((info.state.subjects or {}).values())
    if expected == 0:
        return []
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        filter_subject=subject,
        inactive_threshold=30.0,  # the server removes it even if this process dies mid-read
        mem_storage=True,
    )
    sub = await js.pull_subscribe(subject, stream=stream, config=config)
    entries: list[TimelineEntry] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=1.0)
            except TimeoutError:  # nats-py raises its own subclass or the builtin, depending on the path
                break
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                try:
                    entries.append(TimelineEntry(seq, msg.subject, decode(msg.subject, msg.headers, msg.data)))
                except DecodeError as exc:
                    entries.append(TimelineEntry(seq, msg.subject, None, str(exc)))
            if msgs and msgs[-1].metadata.num_pending == 0 and len(entries) >= expected:
                break
    finally:
        with contextlib.suppress(Exception):
            consumer = (await sub.consumer_info()).name
            await js.delete_consumer(stream, consumer)
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return entries


async def job_timeline(js: JetStreamContext, job_id: str) -> list[TimelineEntry]:
    """The job's whole timeline: every event on `lanes.job.<job_id>.>`."""
    return await read_stream(js, JOBS.name, f"lanes.job.{job_id}.>")
