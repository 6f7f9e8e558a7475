"""Commands: what a user, an operator or recovery asks of a job (cancel, retry, hold, resume)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import AwareDatetime, Field

from lanes_contract.events.base import Data, Event, Family, Lane
from lanes_contract.jobs import Token


class CommandData(Data):
    """Who asked, and why."""

    reason: str = ""
    requested_by: str = ""


class CancelRequested(Event):
    """A user asked to cancel the job (its current attempt)."""

    family = Family.JOB
    name = "cancel_requested"
    lane: Lane = Lane.ALGORITHM
    data: CommandData


class RetryData(CommandData):
    """A retry, optionally pinned to the verified checkpoint step it must resume from."""

    resume_step: int | None = Field(
        default=None, ge=0, description="The step of the verified checkpoint; unset: the latest saved one."
    )
    avoid_nodes: tuple[Token, ...] = Field(
        default=(), description="Nodes the new attempt must not be placed on, e.g. the ones recovery cordoned."
    )


class RetryRequested(Event):
    """A user asked for a new attempt; `attempt` names the attempt being retried (a stale one is rejected)."""

    family = Family.JOB
    name = "retry_requested"
    lane: Lane = Lane.ALGORITHM
    data: RetryData


class HoldRequestedData(CommandData):
    """Who owns the manual decision, and by when."""

    owner: str = ""
    deadline: AwareDatetime | None = None


class HoldRequested(Event):
    """Put a finished-but-not-succeeded job on the manual path: no retry until an owner resumes it."""

    family = Family.JOB
    name = "hold_requested"
    lane: Lane = Lane.PLATFORM
    data: HoldRequestedData


class ResumeRequested(Event):
    """The owner of a held job decided: start a new attempt (from `resume_step` when it is pinned)."""

    family = Family.JOB
    name = "resume_requested"
    lane: Lane = Lane.PLATFORM
    data: RetryData


class DrillKind(StrEnum):
    """The real faults `lanes drill` injects into a running rank, or into an inference replica (`replica-*`)."""

    KILL = "kill"
    """SIGKILL the rank."""
    HANG = "hang"
    """SIGSTOP the rank (and SIGCONT it after a duration, if one is given)."""
    SLOW = "slow"
    """Stop and continue the rank in turn (a duty cycle) for a duration: a straggler, not a failure."""
    OOM = "oom"
    """Shrink the rank's memory cgroup below its use: the kernel's OOM killer kills it."""
    XID = "xid"
    """Write an NVRM Xid line naming the rank's pid to the kernel log, then fail its next CUDA call (simulated)."""
    EXCEPTION = "exception"
    """Make the rank raise an exception through the drill workload's fault hook (SIGUSR1)."""
    LINK_DOWN = "link-down"
    """Bring the rank's node's link down (its veth, with `lanes up --netns`), and up after a duration if given."""
    LINK_SLOW = "link-slow"
    """Rate-limit the rank's node's link both ways (a `tbf` on each end of its veth) for a duration: it degrades."""
    REPLICA_KILL = "replica-kill"
    """SIGKILL an inference replica's server with streams in flight: the router must continue them elsewhere."""
    REPLICA_PAUSE = "replica-pause"
    """SIGSTOP an inference replica's server (a hang after the first token), and SIGCONT it after a duration."""
    REPLICA_DRAIN = "replica-drain"
    """Drain an inference replica with streams in flight (and put it back in rotation after a duration, if given)."""


class DrillInjectedData(Data):
    """What was injected, where, and by whom."""

    kind: DrillKind
    node: Token
    rank: int | None = Field(default=None, ge=0)
    pid: int | None = Field(default=None, ge=1, description="The process the fault was injected into.")
    duration_s: float | None = Field(default=None, gt=0, description="How long a hang or slow-down lasts.")
    requested_by: str = ""
    detail: str = Field(default="", max_length=1024, description="How it was done (the signal, the kernel line).")


class DrillInjected(Event):
    """An operator injected a real fault into a running job (`lanes drill`), to see who sees what, and when.

    No service reads it: the platform must find the fault from the evidence, as it would an unplanned one.
    `lanes poc` reads it to time the detection, localisation, decision and recovery, and to judge the finding.
    """

    family = Family.JOB
    name = "drill_injected"
    lane: Lane = Lane.PLATFORM
    data: DrillInjectedData
