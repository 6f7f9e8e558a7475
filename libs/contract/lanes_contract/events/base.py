"""The envelope every event shares: CloudEvents context attributes plus the Lanes join keys.

Each event type names its subject family and its last subject token (`name`); its CloudEvents `type` is
derived from them by one rule, `io.lanes.<family>.<name>.v1`, so the two can never disagree.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from lanes_contract.ids import derived_event_id, new_event_id
from lanes_contract.jobs import Token


class Lane(StrEnum):
    """The responsibility lane an event's evidence belongs to (docs/architecture.md, "Lanes")."""

    ALGORITHM = "algorithm"
    PLATFORM = "platform"
    HOST = "host"
    NETWORK = "network"


class Family(StrEnum):
    """Subject families; each maps to one stream (see `lanes_contract.streams`)."""

    JOB = "job"
    NODE = "node"
    TELEMETRY = "tel"
    REQUEST = "req"
    BEAT = "beat"


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
    type: str = ""
    """`io.lanes.<family>.<name>.v1`, set on each concrete event type by `__init_subclass__`."""
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The one place the type-name rule is written: a concrete event (one that sets `name`) gets
        # `type: Literal["io.lanes.<family>.<name>.v1"]`, which is also the discriminator of `AnyEvent`.
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            event_type = f"io.lanes.{cls.family}.{cls.name}.v1"
            literal: Any = Literal
            cls.__annotations__["type"] = literal[event_type]
            setattr(cls, "type", event_type)  # noqa: B010 - `type` is an instance field to mypy

    @model_validator(mode="after")
    def _has_subject_keys(self) -> Event:
        # The subject is built from these keys, so an event without them could never be routed.
        if self.family is Family.JOB and self.jobid is None:
            msg = f"{self.type} needs jobid: it is published on lanes.job.<jobid>.{self.name}"
            raise ValueError(msg)
        if self.family in {Family.NODE, Family.TELEMETRY, Family.BEAT} and self.node is None:
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
        id=derived_event_id(cause.id, event_type, key, at=cause.time),
        causationid=cause.id,
        **(defaults | fields),
    )


class Data(BaseModel):
    """Base of every event's payload: frozen, and no field it does not declare."""

    model_config = ConfigDict(frozen=True, extra="forbid")
