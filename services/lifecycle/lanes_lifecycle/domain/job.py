"""The job state machine as a pure fold: `evolve(view, event)` returns the next view and the transition.

Skeleton rules (the lifecycle issue adds starting, checkpointing, partial failure, retries and manual
paths): submitted jobs are queued; a placement admits them; the first rank start makes them running;
all ranks exiting 0 succeeds them, any other exit fails them; the scheduler's release ends the story.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from lanes_common.errors import PoisonEventError
from lanes_common.events import (
    Event,
    JobPlaced,
    JobSubmitted,
    JobWaiting,
    RankAssignment,
    RankExited,
    RankStarted,
    ResourcesReleased,
)
from lanes_common.jobs import JobSpec, JobState


class IllegalTransitionError(PoisonEventError):
    """An event that the job's current state does not allow (e.g. a placement for a finished job)."""


class Attempt(BaseModel):
    """One run of a job: where it was placed, which ranks started and ended, and how it ended."""

    model_config = ConfigDict(frozen=True)

    number: int
    state: JobState
    placement: tuple[RankAssignment, ...] = ()
    started_ranks: frozenset[int] = frozenset()
    succeeded_ranks: frozenset[int] = frozenset()
    failed_ranks: frozenset[int] = frozenset()
    started_at: datetime | None = None
    ended_at: datetime | None = None
    cause: str | None = None


class JobView(BaseModel):
    """What the lifecycle knows about one job: its spec, base state, wait reason and attempts."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    spec: JobSpec
    state: JobState
    wait_reason: str | None = None
    attempts: tuple[Attempt, ...]

    @property
    def current(self) -> Attempt:
        """The latest attempt."""
        return self.attempts[-1]


class Transition(BaseModel):
    """A change of base state and why it happened."""

    model_config = ConfigDict(frozen=True)

    from_state: JobState | None
    to_state: JobState
    reason: str


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


def evolve(view: JobView | None, event: Event) -> tuple[JobView, Transition | None]:
    """Apply one event to a job; raise IllegalTransitionError when the job's state forbids it."""
    if isinstance(event, JobSubmitted):
        if view is not None:
            raise IllegalTransitionError(f"job {event.jobid} was already submitted")
        queued = JobView(
            job_id=str(event.jobid),
            spec=event.data.spec,
            state=JobState.QUEUED,
            attempts=(Attempt(number=event.attempt or 1, state=JobState.QUEUED),),
        )
        return queued, Transition(from_state=JobState.SUBMITTED, to_state=JobState.QUEUED, reason="submitted")
    if view is None:
        raise IllegalTransitionError(f"{event.type} for job {event.jobid}, which was never submitted")
    if event.attempt is not None and event.attempt != view.current.number:
        raise IllegalTransitionError(
            f"{event.type} is for attempt {event.attempt}; the current attempt is {view.current.number}"
        )
    if isinstance(event, JobWaiting):
        _require(view, event, {JobState.QUEUED})
        return view.model_copy(update={"wait_reason": event.data.reason}), None
    if isinstance(event, JobPlaced):
        _require(view, event, {JobState.QUEUED})
        attempt = view.current.model_copy(update={"placement": event.data.assignments})
        return _move(view, attempt, JobState.ADMITTED, "placed", wait_reason=None)
    if isinstance(event, RankStarted):
        _require(view, event, {JobState.ADMITTED, JobState.RUNNING})
        attempt = view.current.model_copy(
            update={
                "started_ranks": view.current.started_ranks | {_rank(event)},
                "started_at": view.current.started_at or event.time,
            }
        )
        if view.state is JobState.RUNNING:
            return _replace_current(view, attempt), None
        return _move(view, attempt, JobState.RUNNING, f"rank {_rank(event)} started")
    if isinstance(event, RankExited):
        return _rank_exited(view, event)
    if isinstance(event, ResourcesReleased):
        _require(view, event, TERMINAL)
        return _move(view, view.current, JobState.RELEASED, f"{event.data.gpus} GPUs released")
    raise IllegalTransitionError(f"the lifecycle does not handle {event.type}")


def _rank_exited(view: JobView, event: RankExited) -> tuple[JobView, Transition | None]:
    _require(view, event, {JobState.RUNNING, JobState.FAILED})
    rank = _rank(event)
    current = view.current
    if event.data.succeeded:
        attempt = current.model_copy(update={"succeeded_ranks": current.succeeded_ranks | {rank}})
    else:
        attempt = current.model_copy(update={"failed_ranks": current.failed_ranks | {rank}})
    if view.state is JobState.FAILED:
        return _replace_current(view, attempt), None  # later exits of a failed attempt are recorded only
    if not event.data.succeeded:
        how = f"signal {event.data.signal}" if event.data.signal else f"exit code {event.data.exit_code}"
        node = event.node or next((a.node for a in current.placement if a.rank == rank), "an unknown node")
        reason = f"rank {rank} on {node} ended with {how}"
        return _move(view, attempt.model_copy(update={"ended_at": event.time}), JobState.FAILED, reason)
    if len(attempt.succeeded_ranks) == view.spec.workers:
        done = attempt.model_copy(update={"ended_at": event.time})
        return _move(view, done, JobState.SUCCEEDED, "all ranks exited 0")
    return _replace_current(view, attempt), None


def _require(view: JobView, event: Event, allowed: set[JobState] | frozenset[JobState]) -> None:
    if view.state not in allowed:
        raise IllegalTransitionError(f"{event.type} is not allowed for job {view.job_id} in state {view.state}")


def _rank(event: Event) -> int:
    if event.rank is None:
        raise IllegalTransitionError(f"{event.type} for job {event.jobid} has no rank")
    return event.rank


def _replace_current(view: JobView, attempt: Attempt) -> JobView:
    return view.model_copy(update={"attempts": (*view.attempts[:-1], attempt)})


def _move(
    view: JobView, attempt: Attempt, to_state: JobState, reason: str, **changes: object
) -> tuple[JobView, Transition]:
    moved = attempt.model_copy(update={"state": to_state, "cause": reason if to_state in TERMINAL else attempt.cause})
    after = _replace_current(view, moved).model_copy(update={"state": to_state, **changes})
    return after, Transition(from_state=view.state, to_state=to_state, reason=reason)
