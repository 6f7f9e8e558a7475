"""Commands: what a user, an operator or recovery asks of a job (cancel, retry, hold, resume)."""

from __future__ import annotations

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
