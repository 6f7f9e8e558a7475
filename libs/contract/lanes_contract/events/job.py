"""Jobs: submission, waiting, placement, rank start and exit, state changes, release (`lanes.job.<job>.<name>`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lanes_contract.events.base import Data, Event, Family, Lane
from lanes_contract.jobs import FailureCause, JobSpec, JobState, Token


class JobSubmittedData(Data):
    """The submitted spec."""

    spec: JobSpec


class JobSubmitted(Event):
    """A user or client asked for a job to run."""

    family = Family.JOB
    name = "submitted"
    lane: Lane = Lane.PLATFORM
    data: JobSubmittedData


class BlockingResource(Data):
    """One thing that keeps a job waiting: a node, a topology domain, a quota, a pool or a reservation."""

    kind: Literal["node", "domain", "quota", "pool", "reservation", "capacity"]
    id: str = Field(min_length=1)
    holders: tuple[str, ...] = Field(default=(), description="Jobs holding GPUs of this resource.")
    free_gpus: int | None = None
    state: str | None = Field(default=None, description="For a node: cordoned, draining or unhealthy.")
    reason: str = ""
    owner_lane: Lane | None = None


class JobWaitingData(Data):
    """Why a job waits, and where it stands in the queue."""

    reason: str = Field(min_length=1, description="Why the job cannot be placed yet, e.g. capacity_short.")
    detail: str = ""
    queue_position: int | None = Field(default=None, ge=1)
    # --- scheduler: the structured reason (defaults keep older events readable) ---
    owner_lane: Lane | None = Field(default=None, description="The lane that can unblock the job.")
    blocking: tuple[BlockingResource, ...] = Field(default=(), description="What blocks it, and who holds it.")
    figures: dict[str, int] = Field(default_factory=dict, description="The numbers behind the reason.")


class JobWaiting(Event):
    """The scheduler cannot place the job yet, and says why."""

    family = Family.JOB
    name = "waiting"
    lane: Lane = Lane.PLATFORM
    data: JobWaitingData


class RankAssignment(Data):
    """Where one rank runs: its node and the GPU indices it holds there."""

    rank: int = Field(ge=0)
    node: Token
    gpus: tuple[int, ...] = Field(description="GPU indices on the node given to this rank.")


class JobPlacedData(Data):
    """The placement of every rank of the gang."""

    assignments: tuple[RankAssignment, ...] = Field(min_length=1)
    level: str | None = Field(default=None, description="The topology level holding the whole gang, e.g. leaf.")
    domain: str | None = Field(default=None, description="The domain at that level, e.g. leaf-3.")

    @property
    def nodes(self) -> tuple[str, ...]:
        """The distinct nodes of the placement, in rank order."""
        return tuple(dict.fromkeys(a.node for a in self.assignments))


class JobPlaced(Event):
    """The scheduler admitted the job's gang and placed every rank."""

    family = Family.JOB
    name = "placed"
    lane: Lane = Lane.PLATFORM
    data: JobPlacedData


class RankStartedData(Data):
    """The started process."""

    pid: int | None = Field(
        default=None, ge=1, description="The process id, or None when the producer does not see the process."
    )


class RankStarted(Event):
    """A launcher started the process of one rank."""

    family = Family.JOB
    name = "rank_started"
    lane: Lane = Lane.HOST
    data: RankStartedData


class RankExitedData(Data):
    """How a rank's process ended."""

    exit_code: int | None = Field(description="Process exit status, or None when killed by a signal.")
    signal: int | None = Field(default=None, ge=1)
    evidence: int | None = Field(
        default=None,
        ge=0,
        description="How many evidence events the agent published from this rank's output before its exit: "
        "telemetry knows the rank has reported everything once it has seen that many.",
    )
    start_error: str | None = Field(
        default=None,
        max_length=1024,
        description="The OS error that kept the process from starting (a missing binary, an argument list too "
        "long): the rank never ran, so no exit status exists.",
    )
    killed_after_grace_s: float | None = Field(
        default=None,
        gt=0,
        description="The agent stopped the rank (SIGTERM), and SIGKILLed it when it had not exited this many "
        "seconds later (stopped, hung in the kernel, or ignoring signals). The stop is the cause, not the kill.",
    )
    lost: str | None = Field(
        default=None,
        max_length=1024,
        description="The agent lost track of the rank: it restarted while the rank ran, found it still running "
        "(and killed it) or already gone, so the rank's own exit status is unknown. Says which, and why.",
    )

    @property
    def succeeded(self) -> bool:
        """Whether the rank exited normally with status 0."""
        return self.exit_code == 0 and self.signal is None


class RankExited(Event):
    """The process of one rank ended, with its exit status or the signal that killed it."""

    family = Family.JOB
    name = "rank_exited"
    lane: Lane = Lane.HOST
    data: RankExitedData


class JobStateChangedData(Data):
    """A transition of the job's base state."""

    from_state: JobState | None
    to_state: JobState
    cause_type: str = Field(description="The `type` of the event that caused the transition.")
    reason: str = ""
    # --- lifecycle: why an attempt ended, and which transition of the job this is (defaults: older events) ---
    cause: FailureCause | None = Field(default=None, description="Set when the transition ends an attempt.")
    sequence: int | None = Field(default=None, ge=1, description="1 for the job's first transition, then 2, 3...")


class JobStateChanged(Event):
    """The lifecycle service moved a job (and its attempt) to a new state; causationid is the cause."""

    family = Family.JOB
    name = "state_changed"
    lane: Lane = Lane.PLATFORM
    data: JobStateChangedData


class ResourcesReleasedData(Data):
    """What the scheduler freed."""

    nodes: tuple[Token, ...]
    gpus: int = Field(ge=0)


class ResourcesReleased(Event):
    """The scheduler freed the allocation of a finished attempt."""

    family = Family.JOB
    name = "resources_released"
    lane: Lane = Lane.PLATFORM
    data: ResourcesReleasedData
