"""Declarative definitions of the JetStream streams that hold the Lanes timeline, and their provisioning.

Provisioning is idempotent and only ever strengthens a stream: it adds missing subjects, raises limits
and replicas, lowers the largest message it accepts to what an event can be, and switches on audit
protections, but it refuses (StreamConflictError) to shorten retention, drop subjects or change the
retention or storage kind of a stream that already exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from lanes_contract.codec import MAX_EVENT_BYTES
from lanes_contract.errors import StreamConflictError
from lanes_contract.events import Family

_DAY = 86_400.0
_MINUTE = 60.0
log = structlog.get_logger(__name__)

MAX_EVENT_HEADER_BYTES = 16 * 1024
"""Room for an event's headers: its CloudEvents attributes (ids and tokens of at most 128 characters), the
trace context and the signature take a few hundred bytes; the rest is margin, not an allowance to use."""
MAX_EVENT_MESSAGE_BYTES = MAX_EVENT_BYTES + MAX_EVENT_HEADER_BYTES
"""The largest message (headers and payload) a stream of events stores: the largest event the codec lets
out, so a message no producer could have encoded is refused by the server, whoever builds it."""
DEAD_LETTER_HEADER_BYTES = 8 * 1024
"""What dead-lettering adds to a message: where and why it died (the reason is cut at 1 KiB)."""
MAX_PAYLOAD_BYTES = MAX_EVENT_MESSAGE_BYTES + DEAD_LETTER_HEADER_BYTES
"""The server's (and so every account's) `max_payload`: the largest message any stream accepts, a dead
letter. Any bigger publish is refused by the server before it reaches JetStream (nats-server's default is
1 MiB)."""


@dataclass(frozen=True)
class StreamSpec:
    """What Lanes needs of one stream. Limits of -1 mean unlimited; ages are seconds (0 = keep forever)."""

    name: str
    subjects: tuple[str, ...]
    description: str
    max_age_s: float
    duplicate_window_s: float
    max_msgs_per_subject: int = -1
    deny_delete: bool = False
    deny_purge: bool = False
    replicas: int = 1
    max_msg_size: int = MAX_EVENT_MESSAGE_BYTES
    # Every stream here is a log kept by limits, never by acknowledgement: replays and audits must be able
    # to read what consumers have already processed.
    retention: RetentionPolicy = field(default=RetentionPolicy.LIMITS)
    storage: StorageType = field(default=StorageType.FILE)

    def config(self) -> StreamConfig:
        """The nats-py configuration of this stream."""
        return StreamConfig(
            name=self.name,
            description=self.description,
            subjects=list(self.subjects),
            retention=self.retention,
            storage=self.storage,
            max_age=self.max_age_s,
            max_msgs=-1,
            max_bytes=-1,
            max_msgs_per_subject=self.max_msgs_per_subject,
            max_msg_size=self.max_msg_size,
            discard=DiscardPolicy.OLD,
            duplicate_window=self.duplicate_window_s,
            num_replicas=self.replicas,
            deny_delete=self.deny_delete,
            deny_purge=self.deny_purge,
            allow_direct=True,
        )


JOBS = StreamSpec(
    name="LANES_JOBS",
    subjects=("lanes.job.>",),
    description="The job timeline: submissions, placements, rank events, state changes, evidence copies.",
    # The audit timeline: kept a year, and nobody may delete or purge single events from it.
    max_age_s=365 * _DAY,
    # Wide enough to cover a service that crashes after storing an output and publishes it again on restart.
    duplicate_window_s=10 * _MINUTE,
    deny_delete=True,
    deny_purge=True,
)
NODES = StreamSpec(
    name="LANES_NODES",
    subjects=("lanes.node.>",),
    description="Node inventory and node state changes (ready, cordoned, draining, unhealthy).",
    max_age_s=90 * _DAY,
    duplicate_window_s=10 * _MINUTE,
    deny_delete=True,
)
TELEMETRY = StreamSpec(
    name="LANES_TELEMETRY",
    subjects=("lanes.tel.>",),
    description="Raw evidence from node agents; correlated copies go to the job timeline.",
    # High volume: a week is enough to re-run correlation; what matters is copied to LANES_JOBS.
    max_age_s=7 * _DAY,
    duplicate_window_s=2 * _MINUTE,
)
REQUESTS = StreamSpec(
    name="LANES_REQUESTS",
    subjects=("lanes.req.>",),
    description="Per-request provenance from the router.",
    max_age_s=30 * _DAY,
    duplicate_window_s=2 * _MINUTE,
)
DEAD = StreamSpec(
    name="LANES_DEAD",
    subjects=("lanes.dead.>",),
    description="Dead letters: messages no consumer could process, with the reason and original sequence.",
    max_age_s=90 * _DAY,
    duplicate_window_s=10 * _MINUTE,
    deny_delete=True,
    max_msg_size=MAX_PAYLOAD_BYTES,  # a message of any stream, with where and why it died
)
AUDIT = StreamSpec(
    name="LANES_AUDIT",
    subjects=("lanes.audit.>",),
    description="Signed checkpoints of the audit hash chain.",
    max_age_s=0,  # kept for good: a checkpoint is evidence about the whole history before it
    duplicate_window_s=10 * _MINUTE,
    deny_delete=True,
    deny_purge=True,
)
BEATS = StreamSpec(
    name="LANES_BEATS",
    subjects=("lanes.beat.>",),
    description="The latest heartbeat of each node agent, with the node's inventory.",
    # "Alive now" has no history worth keeping: one message per node, and a node silent for a day is gone.
    max_age_s=_DAY,
    duplicate_window_s=2 * _MINUTE,
    max_msgs_per_subject=1,
)
ALL_STREAMS = (JOBS, NODES, TELEMETRY, REQUESTS, BEATS, DEAD, AUDIT)
STREAM_OF_FAMILY = {
    Family.JOB: JOBS,
    Family.NODE: NODES,
    Family.TELEMETRY: TELEMETRY,
    Family.REQUEST: REQUESTS,
    Family.BEAT: BEATS,
}


async def provision_streams(
    js: JetStreamContext, specs: tuple[StreamSpec, ...] = ALL_STREAMS, *, replicas: int = 1
) -> dict[str, str]:
    """Create or strengthen each stream; return what was done per stream: created, updated or unchanged."""
    outcome: dict[str, str] = {}
    for spec in specs:
        wanted = replace(spec, replicas=max(spec.replicas, replicas)).config()
        try:
            existing = (await js.stream_info(spec.name)).config
        except NotFoundError:
            await js.add_stream(wanted)
            outcome[spec.name] = "created"
            continue
        merged = strengthened(existing, wanted)
        if merged is None:
            outcome[spec.name] = "unchanged"
            continue
        await js.update_stream(merged)
        outcome[spec.name] = "updated"
    log.info("streams provisioned", **outcome)
    return outcome


def _age_rank(age: float | None) -> float:
    # 0 (or unset) means "keep forever", the longest retention there is.
    return age or float("inf")


def _limit_rank(limit: int | None) -> float:
    return float("inf") if limit is None or limit < 0 else float(limit)


def _size_rank(limit: int | None) -> float:
    # nats-server takes 0 (or unset) like -1: any size up to the server's max_payload.
    return float("inf") if not limit or limit < 0 else float(limit)


def strengthened(existing: StreamConfig, wanted: StreamConfig) -> StreamConfig | None:
    """The existing config raised to at least what is wanted, None if it already is, or a conflict error."""
    name = existing.name
    for attr in ("retention", "storage"):
        if getattr(existing, attr) != getattr(wanted, attr):
            msg = (
                f"stream {name} has {attr}={getattr(existing, attr)}, Lanes needs {getattr(wanted, attr)}; "
                "this cannot be changed in place: migrate the stream by hand"
            )
            raise StreamConflictError(msg)
    changes: dict[str, Any] = {}
    subjects = list(existing.subjects or [])
    missing = [s for s in wanted.subjects or [] if s not in subjects]
    if missing:
        changes["subjects"] = subjects + missing
    if _age_rank(existing.max_age) < _age_rank(wanted.max_age):
        changes["max_age"] = wanted.max_age
    for attr in ("max_msgs", "max_bytes", "max_msgs_per_subject"):
        if _limit_rank(getattr(existing, attr)) < _limit_rank(getattr(wanted, attr)):
            changes[attr] = getattr(wanted, attr)
    if _size_rank(existing.max_msg_size) > _size_rank(wanted.max_msg_size):
        changes["max_msg_size"] = wanted.max_msg_size  # lowered: a bigger message is no event of ours
    if (existing.duplicate_window or 0) < (wanted.duplicate_window or 0):
        changes["duplicate_window"] = wanted.duplicate_window
    if (existing.num_replicas or 1) < (wanted.num_replicas or 1):
        changes["num_replicas"] = wanted.num_replicas
    for attr in ("deny_delete", "deny_purge", "allow_direct"):
        if getattr(wanted, attr) and not getattr(existing, attr):
            changes[attr] = True
    if not changes:
        return None
    return replace(existing, **changes)
