"""The one event catalogue: a frozen pydantic model per event type, discriminated by `type`.

Every event carries the CloudEvents 1.0 context attributes plus the Lanes join keys (lane, job id,
attempt, node, rank, causation and correlation ids, trace context). Each event type knows which subject
family it belongs to, so its NATS subject is derived from its own join keys and can never disagree with
them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from lanes_common.ids import derived_event_id, new_event_id
from lanes_common.jobs import JobSpec, JobState, Token


class Lane(StrEnum):
    """The responsibility lane an event's evidence belongs to (DESIGN.md, "Lanes")."""

    ALGORITHM = "algorithm"
    PLATFORM = "platform"
    HOST = "host"
    NETWORK = "network"


class Family(StrEnum):
    """Subject families; each maps to one stream (see `lanes_common.streams`)."""

    JOB = "job"
    NODE = "node"
    TELEMETRY = "tel"
    REQUEST = "req"


def utc_now() -> datetime:
    """The current time in UTC, at the microsecond precision `ce-time` carries."""
    return datetime.now(UTC)


_TRACEPARENT = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
HeaderText = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]*$")]
"""Text that travels in a NATS header: no control characters, so no CR/LF can inject another header."""


class Event(BaseModel):
    """Envelope shared by all event types. Subclasses fix `type`, the data model and the subject."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: ClassVar[Family]
    name: ClassVar[str]
    """The last subject token, e.g. `submitted` in `lanes.job.<job>.submitted`."""

    id: HeaderText = Field(default_factory=new_event_id, min_length=1, max_length=128)
    source: HeaderText = Field(min_length=1, max_length=256)
    type: str
    time: AwareDatetime = Field(default_factory=utc_now)
    subject: HeaderText | None = Field(default=None, max_length=512)
    lane: Lane
    jobid: Token | None = None
    attempt: int | None = Field(default=None, ge=1)
    node: Token | None = None
    rank: int | None = Field(default=None, ge=0)
    causationid: HeaderText | None = Field(default=None, max_length=128)
    correlationid: HeaderText | None = Field(default=None, max_length=128)
    traceparent: str | None = Field(default=None, pattern=_TRACEPARENT)
    data: Any

    @model_validator(mode="after")
    def _has_subject_keys(self) -> Event:
        # The subject is built from these keys, so an event without them could never be routed.
        if self.family is Family.JOB and self.jobid is None:
            msg = f"{self.type} needs jobid: it is published on lanes.job.<jobid>.{self.name}"
            raise ValueError(msg)
        if self.family in {Family.NODE, Family.TELEMETRY} and self.node is None:
            msg = f"{self.type} needs node: it is published on lanes.{self.family}.<node>.{self.name}"
            raise ValueError(msg)
        return self

    @property
    def job_key(self) -> str:
        """The job id of a job-family event (validated present at construction)."""
        if self.jobid is None:
            msg = f"{self.type} carries no job id"
            raise ValueError(msg)
        return self.jobid

    @property
    def node_key(self) -> str:
        """The node id of a node- or telemetry-family event (validated present at construction)."""
        if self.node is None:
            msg = f"{self.type} carries no node id"
            raise ValueError(msg)
        return self.node

    def nats_subject(self) -> str:
        """The subject this event is published on; its tokens are the event's own join keys."""
        key = self.jobid if self.family is Family.JOB else self.node
        return f"lanes.{self.family}.{key}.{self.name}"


_E = TypeVar("_E", bound=Event)


def derive(cls: type[_E], cause: Event, *, key: str = "", **fields: Any) -> _E:
    """Build an event caused by `cause`, with a deterministic id so a handler that runs twice emits it once.

    `key` tells apart several events of the same type caused by one event (e.g. one per rank). The join
    keys of the cause are carried over unless given.
    """
    event_type = cls.model_fields["type"].default
    defaults: dict[str, Any] = {
        "jobid": cause.jobid,
        "attempt": cause.attempt,
        "correlationid": cause.correlationid or cause.id,
        "traceparent": cause.traceparent,
    }
    return cls(
        id=derived_event_id(cause.id, event_type, key),
        causationid=cause.id,
        **(defaults | fields),
    )


class _Data(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- job family: lanes.job.<job_id>.<name> -------------------------------------------------------


class JobSubmittedData(_Data):
    """The submitted spec."""

    spec: JobSpec


class JobSubmitted(Event):
    """A user or client asked for a job to run."""

    family = Family.JOB
    name = "submitted"
    type: Literal["io.lanes.job.submitted.v1"] = "io.lanes.job.submitted.v1"
    lane: Lane = Lane.PLATFORM
    data: JobSubmittedData


class JobWaitingData(_Data):
    """Why a job waits, and where it stands in the queue."""

    reason: str = Field(min_length=1, description="Why the job cannot be placed yet, e.g. capacity_short.")
    detail: str = ""
    queue_position: int | None = Field(default=None, ge=1)


class JobWaiting(Event):
    """The scheduler cannot place the job yet, and says why."""

    family = Family.JOB
    name = "waiting"
    type: Literal["io.lanes.job.waiting.v1"] = "io.lanes.job.waiting.v1"
    lane: Lane = Lane.PLATFORM
    data: JobWaitingData


class RankAssignment(_Data):
    """Where one rank runs: its node and the GPU indices it holds there."""

    rank: int = Field(ge=0)
    node: Token
    gpus: tuple[int, ...] = Field(description="GPU indices on the node given to this rank.")


class JobPlacedData(_Data):
    """The placement of every rank of the gang."""

    assignments: tuple[RankAssignment, ...] = Field(min_length=1)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The distinct nodes of the placement, in rank order."""
        return tuple(dict.fromkeys(a.node for a in self.assignments))


class JobPlaced(Event):
    """The scheduler admitted the job's gang and placed every rank."""

    family = Family.JOB
    name = "placed"
    type: Literal["io.lanes.job.placed.v1"] = "io.lanes.job.placed.v1"
    lane: Lane = Lane.PLATFORM
    data: JobPlacedData


class RankStartedData(_Data):
    """The started process."""

    pid: int = Field(ge=1)


class RankStarted(Event):
    """A launcher started the process of one rank."""

    family = Family.JOB
    name = "rank_started"
    type: Literal["io.lanes.job.rank_started.v1"] = "io.lanes.job.rank_started.v1"
    lane: Lane = Lane.HOST
    data: RankStartedData


class RankExitedData(_Data):
    """How a rank's process ended."""

    exit_code: int | None = Field(description="Process exit status, or None when killed by a signal.")
    signal: int | None = Field(default=None, ge=1)

    @property
    def succeeded(self) -> bool:
        """Whether the rank exited normally with status 0."""
        return self.exit_code == 0 and self.signal is None


class RankExited(Event):
    """The process of one rank ended, with its exit status or the signal that killed it."""

    family = Family.JOB
    name = "rank_exited"
    type: Literal["io.lanes.job.rank_exited.v1"] = "io.lanes.job.rank_exited.v1"
    lane: Lane = Lane.HOST
    data: RankExitedData


class JobStateChangedData(_Data):
    """A transition of the job's base state."""

    from_state: JobState | None
    to_state: JobState
    cause_type: str = Field(description="The `type` of the event that caused the transition.")
    reason: str = ""


class JobStateChanged(Event):
    """The lifecycle service moved a job (and its attempt) to a new state; causationid is the cause."""

    family = Family.JOB
    name = "state_changed"
    type: Literal["io.lanes.job.state_changed.v1"] = "io.lanes.job.state_changed.v1"
    lane: Lane = Lane.PLATFORM
    data: JobStateChangedData


class ResourcesReleasedData(_Data):
    """What the scheduler freed."""

    nodes: tuple[Token, ...]
    gpus: int = Field(ge=0)


class ResourcesReleased(Event):
    """The scheduler freed the allocation of a finished attempt."""

    family = Family.JOB
    name = "resources_released"
    type: Literal["io.lanes.job.resources_released.v1"] = "io.lanes.job.resources_released.v1"
    lane: Lane = Lane.PLATFORM
    data: ResourcesReleasedData


# --- node family: lanes.node.<node_id>.<name> ----------------------------------------------------


class NodeRegisteredData(_Data):
    """A node's GPUs and labels."""

    gpu_model: str = Field(min_length=1)
    gpus: int = Field(ge=0, le=64)
    gpu_memory_gib: int = Field(ge=0)
    labels: dict[str, str] = Field(default_factory=dict)


class NodeRegistered(Event):
    """A node joined the cluster inventory with its GPUs."""

    family = Family.NODE
    name = "registered"
    type: Literal["io.lanes.node.registered.v1"] = "io.lanes.node.registered.v1"
    lane: Lane = Lane.HOST
    data: NodeRegisteredData


AnyEvent = Annotated[
    JobSubmitted
    | JobWaiting
    | JobPlaced
    | RankStarted
    | RankExited
    | JobStateChanged
    | ResourcesReleased
    | NodeRegistered,
    Field(discriminator="type"),
]
"""Every event type Lanes knows, discriminated by `type`."""

EVENT_TYPES: dict[str, type[Event]] = {cls.model_fields["type"].default: cls for cls in get_args(get_args(AnyEvent)[0])}
"""Event class by its `type`, derived from `AnyEvent` so the catalogue is written down once."""
