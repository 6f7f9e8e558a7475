"""The job state machine as a pure fold: `evolve(view, event)` returns the next view and the transition.

A job keeps one id and numbered attempts. Its base state moves

    queued -> admitted -> starting -> running -> succeeded | failed | cancelled -> released

with `partially_failed` (a rank failed, others still run), `cancelling` (ranks are being stopped),
`retrying` (a new attempt was requested, not placed yet) and `awaiting_manual` (an owner decides) in
between, plus flags that hold alongside the base state (`checkpointing`, `resources_released`). Every
transition names the event that caused it, and a transition that ends an attempt names a FailureCause.

An event the state does not allow raises IllegalTransitionError and leaves the view untouched; the
service layer turns it into a visible `transition_rejected` event. Events of an older attempt (a late
rank exit, the release of its allocation) are recorded against that attempt and never move the job.
Rank events are monotone per rank (started < rendezvous < ready < exited), so a repeated event is a no-op.
"""

from __future__ import annotations

import signal
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, computed_field

from lanes_contract.events import (
    ArtifactProduced,
    CancelRequested,
    CheckpointSaved,
    CheckpointStarted,
    CommunicatorReady,
    Event,
    Heartbeat,
    HoldRequested,
    JobFinding,
    JobPlaced,
    JobRejected,
    JobSubmitted,
    JobWaiting,
    Lane,
    RankAssignment,
    RankExited,
    RankStarted,
    RendezvousDone,
    ResourcesReleased,
    ResumeRequested,
    RetryRequested,
)
from lanes_contract.jobs import FailureCause, JobSpec, JobState


class IllegalTransitionError(Exception):
    """An event that the job's current state does not allow (e.g. a placement for a finished job).

    A domain fact, not a transport decision: the handler records it as `transition_rejected`.
    """


class JobFlag(StrEnum):
    """Conditions that hold alongside the base state."""

    CHECKPOINTING = "checkpointing"
    RESOURCES_RELEASED = "resources_released"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE = frozenset({JobState.ADMITTED, JobState.STARTING, JobState.RUNNING, JobState.PARTIALLY_FAILED})
"""States in which the current attempt holds an allocation and its ranks may run."""
UNPLACED = frozenset({JobState.QUEUED, JobState.RETRYING})
RETRYABLE = frozenset({JobState.FAILED, JobState.CANCELLED, JobState.RELEASED, JobState.AWAITING_MANUAL})

# A signal nobody asked for: SIGKILL is what the OOM killer and a dying node deliver; SIGTERM/SIGINT
# come from an orchestrator (preemption, drain); the rest (SIGSEGV, SIGABRT...) come from the program.
_NODE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGBUS})
_PLATFORM_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


class RankProcess(BaseModel):
    """One rank of one attempt: where it runs and how far it got. Every field only ever moves forward."""

    model_config = ConfigDict(frozen=True)

    rank: int
    node: str
    pid: int | None = None
    started: bool = False
    rendezvous: bool = False
    ready: bool = False
    exited: bool = False
    exit_code: int | None = None
    signal: int | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def state(self) -> str:
        """The furthest stage this rank reached."""
        if self.exited:
            return "succeeded" if self.exit_code == 0 and self.signal is None else "failed"
        for stage in ("ready", "rendezvous", "started"):
            if getattr(self, stage):
                return stage
        return "placed"

    @property
    def running(self) -> bool:
        """Started (or further) and not exited: a process that must end before its attempt can."""
        return (self.started or self.rendezvous or self.ready) and not self.exited


class Checkpoint(BaseModel):
    """A saved checkpoint with its digest: what a retry may resume from."""

    model_config = ConfigDict(frozen=True)

    step: int
    path: str
    digest: str
    saved_at: datetime


class Attempt(BaseModel):
    """One run of a job: placement, ranks, start/end, how it ended, its last verified checkpoint."""

    model_config = ConfigDict(frozen=True)

    number: int
    state: JobState
    requested_at: datetime | None = None
    placement: tuple[RankAssignment, ...] = ()
    ranks: dict[int, RankProcess] = {}
    started_at: datetime | None = None
    ended_at: datetime | None = None
    cause: FailureCause | None = None
    cause_detail: str | None = None
    cause_event_id: str | None = None
    exit_cause: FailureCause | None = None
    """The cause as the rank exits showed it, kept when a telemetry finding refines `cause`."""
    exit_detail: str | None = None
    finding_version: int | None = None
    finding_cause: FailureCause | None = None
    finding_summary: str | None = None
    finding_event_id: str | None = None
    resume_step: int | None = None
    last_checkpoint: Checkpoint | None = None
    checkpoint_started_step: int | None = None
    last_step: int | None = None
    artifacts: dict[str, str] = {}
    released: bool = False

    @computed_field  # type: ignore[prop-decorator]
    @property
    def lost_steps(self) -> int | None:
        """Steps past the last verified checkpoint: the work a failure of this attempt throws away."""
        if self.last_step is None:
            return None
        if self.cause is FailureCause.NORMAL_COMPLETION:
            return 0
        base = self.last_checkpoint.step if self.last_checkpoint else (self.resume_step or 0)
        return max(self.last_step - base, 0)

    @property
    def checkpointing(self) -> bool:
        """A checkpoint was started and not yet saved."""
        if self.checkpoint_started_step is None:
            return False
        return self.last_checkpoint is None or self.last_checkpoint.step < self.checkpoint_started_step

    @property
    def started_ranks(self) -> frozenset[int]:
        """Ranks whose process started."""
        return frozenset(r.rank for r in self.ranks.values() if r.started or r.exited)

    @property
    def succeeded_ranks(self) -> frozenset[int]:
        """Ranks that exited 0."""
        return frozenset(r.rank for r in self.ranks.values() if r.state == "succeeded")

    @property
    def failed_ranks(self) -> frozenset[int]:
        """Ranks that exited otherwise."""
        return frozenset(r.rank for r in self.ranks.values() if r.state == "failed")


class StateSpan(BaseModel):
    """The job entered `state` at `entered_at` (the cause event's time), because of that event."""

    model_config = ConfigDict(frozen=True)

    state: JobState
    entered_at: datetime
    attempt: int
    cause_type: str
    cause_id: str
    reason: str


class ManualPath(BaseModel):
    """Who must decide about a held job, and by when."""

    model_config = ConfigDict(frozen=True)

    owner: str
    deadline: datetime | None
    reason: str


class JobView(BaseModel):
    """What the lifecycle knows about one job: its spec, base state and flags, attempts and history."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    spec: JobSpec
    state: JobState
    wait_reason: str | None = None
    wait_detail: str | None = None
    attempts: tuple[Attempt, ...]
    history: tuple[StateSpan, ...] = ()
    manual: ManualPath | None = None

    @property
    def current(self) -> Attempt:
        """The latest attempt."""
        return self.attempts[-1]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def flags(self) -> tuple[JobFlag, ...]:
        """Flags that hold now, besides the base state."""
        flags = []
        if self.state in ACTIVE and self.current.checkpointing:
            flags.append(JobFlag.CHECKPOINTING)
        if self.current.released:
            flags.append(JobFlag.RESOURCES_RELEASED)
        return tuple(flags)

    def time_in_states(self, now: datetime) -> dict[str, float]:
        """Seconds spent in each base state (the current one counted up to `now`), in first-entered order."""
        spent: dict[str, float] = {}
        ends = [span.entered_at for span in self.history[1:]] + [now]
        for span, end in zip(self.history, ends, strict=True):
            spent[span.state.value] = spent.get(span.state.value, 0.0) + max((end - span.entered_at).total_seconds(), 0)
        return spent


class Transition(BaseModel):
    """A change of base state, why it happened and, when it ends an attempt, the cause."""

    model_config = ConfigDict(frozen=True)

    from_state: JobState | None
    to_state: JobState
    reason: str
    cause: FailureCause | None = None
    sequence: int = 1
    new_attempt: int | None = None
    """Set when the transition created an attempt (retrying): its number."""
    resume_step: int | None = None
    avoid_nodes: tuple[str, ...] = ()
    """Nodes the new attempt must not be placed on, as the retry asked (e.g. the ones recovery cordoned)."""


def evolve(view: JobView | None, event: Event) -> tuple[JobView, Transition | None]:
    """Apply one event to a job; raise IllegalTransitionError when the job's state forbids it."""
    if isinstance(event, JobSubmitted):
        if view is not None:
            raise IllegalTransitionError(f"job {event.jobid} was already submitted")
        if event.attempt not in {None, 1}:
            raise IllegalTransitionError(f"job {event.jobid} is submitted as attempt 1; retries make the others")
        attempt = Attempt(number=event.attempt or 1, state=JobState.QUEUED, requested_at=event.time)
        queued = JobView(job_id=str(event.jobid), spec=event.data.spec, state=JobState.SUBMITTED, attempts=(attempt,))
        return _move(queued, event, attempt, JobState.QUEUED, "submitted")
    if view is None:
        raise IllegalTransitionError(f"{event.type} for job {event.jobid}, which was never submitted")
    number = view.current.number if event.attempt is None else event.attempt
    if number > view.current.number:
        raise IllegalTransitionError(
            f"{event.type} is for attempt {number}; the job has only reached attempt {view.current.number}"
        )
    if number < view.current.number:
        return _old_attempt(view, event, number), None
    return _current_attempt(view, event)


def _current_attempt(view: JobView, event: Event) -> tuple[JobView, Transition | None]:  # noqa: PLR0912 - one branch per input type, as C901
    current = view.current
    if isinstance(event, JobWaiting):
        _require(view, event, UNPLACED)
        waited = view.model_copy(update={"wait_reason": event.data.reason, "wait_detail": event.data.detail})
        if view.state is JobState.RETRYING:
            return _move(waited, event, current, JobState.QUEUED, f"waiting: {event.data.reason}")
        return waited, None
    if isinstance(event, JobRejected):
        _require(view, event, UNPLACED)
        detail = f"rejected by the scheduler: {event.data.reason}" + (
            f" ({event.data.detail})" if event.data.detail else ""
        )
        return _end(view, event, current, JobState.FAILED, cause=FailureCause.PLATFORM_ACTION, detail=detail)
    if isinstance(event, JobPlaced):
        _require(view, event, UNPLACED)
        ranks = {a.rank: RankProcess(rank=a.rank, node=a.node) for a in event.data.assignments}
        placed = current.model_copy(update={"placement": event.data.assignments, "ranks": ranks})
        cleared = view.model_copy(update={"wait_reason": None, "wait_detail": None})
        return _move(cleared, event, placed, JobState.ADMITTED, f"placed on {', '.join(event.data.nodes)}")
    if isinstance(event, RankStarted | RendezvousDone | CommunicatorReady | RankExited):
        return _rank_event(view, event)
    if isinstance(event, Heartbeat | CheckpointStarted | CheckpointSaved | ArtifactProduced):
        _require(view, event, ACTIVE | TERMINAL | {JobState.CANCELLING, JobState.RELEASED, JobState.AWAITING_MANUAL})
        return _replace_current(view, _progress(current, event)), None
    if isinstance(event, CancelRequested):
        return _cancel(view, event)
    if isinstance(event, RetryRequested | ResumeRequested):
        if isinstance(event, ResumeRequested):
            _require(view, event, {JobState.AWAITING_MANUAL})
        return _retry(view, event)
    if isinstance(event, HoldRequested):
        _require(view, event, RETRYABLE - {JobState.AWAITING_MANUAL})
        _require_not_succeeded(view, event)
        lane = _lane_of(current.cause)
        owner = event.data.owner or getattr(view.spec.owners, lane) or f"{lane} on-call"
        manual = ManualPath(owner=owner, deadline=event.data.deadline, reason=event.data.reason or "held")
        held = view.model_copy(update={"manual": manual})
        return _move(held, event, current, JobState.AWAITING_MANUAL, f"held for {owner}: {manual.reason}")
    if isinstance(event, JobFinding):
        return _replace_current(view, _with_finding(current, event)), None
    if isinstance(event, ResourcesReleased):
        _require(view, event, TERMINAL | {JobState.AWAITING_MANUAL})
        freed = current.model_copy(update={"released": True})
        if view.state is JobState.AWAITING_MANUAL:
            return _replace_current(view, freed), None
        return _move(view, event, freed, JobState.RELEASED, f"{event.data.gpus} GPUs released")
    raise IllegalTransitionError(f"the lifecycle does not handle {event.type}")


def _old_attempt(view: JobView, event: Event, number: int) -> JobView:
    """Record an event of an earlier attempt against that attempt; the job itself does not move."""
    index = number - 1
    if index < 0 or view.attempts[index].number != number:
        raise IllegalTransitionError(f"{event.type} names attempt {number}, which this job never had")
    old = view.attempts[index]
    if isinstance(event, RankStarted | RendezvousDone | CommunicatorReady | RankExited):
        _placed_rank(view, old, event)
        updated = old.model_copy(update={"ranks": old.ranks | {_rank(event): _advance(old, event)}})
    elif isinstance(event, Heartbeat | CheckpointStarted | CheckpointSaved | ArtifactProduced):
        updated = _progress(old, event)
    elif isinstance(event, ResourcesReleased):
        updated = old.model_copy(update={"released": True})
    elif isinstance(event, JobFinding):
        updated = _with_finding(old, event)
    else:
        raise IllegalTransitionError(
            f"{event.type} is for attempt {number}, but the job is on attempt {view.current.number}"
        )
    attempts = (*view.attempts[:index], updated, *view.attempts[index + 1 :])
    return view.model_copy(update={"attempts": attempts})


def _rank_event(
    view: JobView, event: RankStarted | RendezvousDone | CommunicatorReady | RankExited
) -> tuple[JobView, Transition | None]:
    if view.state in UNPLACED:
        raise IllegalTransitionError(f"{event.type} for job {view.job_id}, whose attempt is not placed ({view.state})")
    current = view.current
    rank = _placed_rank(view, current, event)
    before = current.ranks[rank]
    after = _advance(current, event)
    if after == before:
        return view, None  # a repeated or overtaken event: nothing new about this rank
    attempt = current.model_copy(
        update={
            "ranks": current.ranks | {rank: after},
            "started_at": current.started_at or (event.time if after.started or after.exited else None),
        }
    )
    if view.state not in ACTIVE | {JobState.CANCELLING}:
        return _replace_current(view, attempt), None  # a late event of a finished attempt: recorded only
    if isinstance(event, RankExited) and not event.data.succeeded and attempt.cause is None:
        cause, detail = _exit_cause(after, event, cancelling=view.state is JobState.CANCELLING)
        attempt = attempt.model_copy(update={"cause": cause, "cause_detail": detail, "cause_event_id": event.id})
    return _decide(view, event, attempt)


def _decide(view: JobView, event: Event, attempt: Attempt) -> tuple[JobView, Transition | None]:
    """Where an active attempt stands after a rank event."""
    ranks = attempt.ranks.values()
    anyone_running = any(r.running for r in ranks)
    if view.state is JobState.CANCELLING:
        if anyone_running:
            return _replace_current(view, attempt), None
        return _end(
            view, event, attempt, JobState.CANCELLED, cause=FailureCause.USER_CANCEL, detail=_cancel_detail(view)
        )
    if attempt.failed_ranks:
        if not anyone_running:
            return _end(view, event, attempt, JobState.FAILED, cause=attempt.cause, detail=attempt.cause_detail or "")
        if view.state is JobState.PARTIALLY_FAILED:
            return _replace_current(view, attempt), None
        failed = ", ".join(str(r) for r in sorted(attempt.failed_ranks))
        return _move(view, event, attempt, JobState.PARTIALLY_FAILED, f"rank {failed} failed; others still run")
    if all(r.exited for r in ranks):
        missing = [a for a in view.spec.success.required_artifacts if a not in attempt.artifacts]
        if missing:
            detail = f"all ranks exited 0 but required artifacts are missing: {', '.join(missing)}"
            return _end(view, event, attempt, JobState.FAILED, cause=FailureCause.USER_CODE_ERROR, detail=detail)
        return _end(
            view, event, attempt, JobState.SUCCEEDED, cause=FailureCause.NORMAL_COMPLETION, detail="all ranks exited 0"
        )
    if view.state is JobState.RUNNING:
        return _replace_current(view, attempt), None
    if all(r.ready for r in ranks):
        return _move(view, event, attempt, JobState.RUNNING, "every rank's communicator is ready")
    if view.state is JobState.ADMITTED:
        return _move(view, event, attempt, JobState.STARTING, f"rank {_rank(event)} is starting")
    return _replace_current(view, attempt), None


def _cancel(view: JobView, event: CancelRequested) -> tuple[JobView, Transition | None]:
    if view.state is JobState.CANCELLING:
        return view, None  # asked again while stopping: the first request stands
    who = f" by {event.data.requested_by}" if event.data.requested_by else ""
    if view.state is JobState.AWAITING_MANUAL:
        # The owner abandons a held job: it ends cancelled, and its attempt keeps the cause it failed with.
        detail = f"abandoned{who}" + (f": {event.data.reason}" if event.data.reason else "")
        return _move(view.model_copy(update={"manual": None}), event, view.current, JobState.CANCELLED, detail)
    _require(view, event, UNPLACED | ACTIVE)
    current = view.current
    if view.state in ACTIVE and any(r.running for r in current.ranks.values()):
        return _move(view, event, current, JobState.CANCELLING, f"cancel requested{who}; stopping ranks")
    detail = f"cancelled{who}" + (f": {event.data.reason}" if event.data.reason else "")
    return _end(view, event, current, JobState.CANCELLED, cause=FailureCause.USER_CANCEL, detail=detail)


def _retry(view: JobView, event: RetryRequested | ResumeRequested) -> tuple[JobView, Transition | None]:
    _require(view, event, RETRYABLE)
    _require_not_succeeded(view, event)
    retries = len(view.attempts) - 1
    if retries >= view.spec.retry_budget:
        raise IllegalTransitionError(f"the retry budget of job {view.job_id} ({view.spec.retry_budget}) is used up")
    checkpoints = [a.last_checkpoint for a in view.attempts if a.last_checkpoint is not None]
    pinned = event.data.resume_step
    resume = pinned if pinned is not None else max((c.step for c in checkpoints), default=None)
    new = Attempt(number=view.current.number + 1, state=JobState.RETRYING, requested_at=event.time, resume_step=resume)
    asked = event.data.reason or ("resumed by its owner" if isinstance(event, ResumeRequested) else "retry requested")
    reopened = view.model_copy(update={"attempts": (*view.attempts, new), "manual": None})
    after, transition = _move(reopened, event, new, JobState.RETRYING, f"attempt {new.number}: {asked}")
    carried = {"new_attempt": new.number, "resume_step": resume, "avoid_nodes": event.data.avoid_nodes}
    return after, transition.model_copy(update=carried)


def _progress(attempt: Attempt, event: Heartbeat | CheckpointStarted | CheckpointSaved | ArtifactProduced) -> Attempt:
    if isinstance(event, Heartbeat):
        return attempt.model_copy(update={"last_step": max(attempt.last_step or 0, event.data.step)})
    if isinstance(event, CheckpointStarted):
        step = max(attempt.checkpoint_started_step or 0, event.data.step)
        return attempt.model_copy(update={"checkpoint_started_step": step})
    if isinstance(event, CheckpointSaved):
        if attempt.last_checkpoint is not None and attempt.last_checkpoint.step >= event.data.step:
            return attempt
        saved = Checkpoint(step=event.data.step, path=event.data.path, digest=event.data.digest, saved_at=event.time)
        return attempt.model_copy(update={"last_checkpoint": saved})
    if event.data.artifact in attempt.artifacts:
        return attempt
    return attempt.model_copy(update={"artifacts": attempt.artifacts | {event.data.artifact: event.data.path}})


def _advance(attempt: Attempt, event: RankStarted | RendezvousDone | CommunicatorReady | RankExited) -> RankProcess:
    """The rank after this event; stages only move forward, so repeats and stragglers change nothing."""
    rank = attempt.ranks[_rank(event)]
    if rank.exited:
        return rank
    if isinstance(event, RankExited):
        return rank.model_copy(
            update={
                "exited": True,
                "exit_code": event.data.exit_code,
                "signal": event.data.signal,
                "ended_at": event.time,
            }
        )
    if isinstance(event, RankStarted):
        if rank.started:
            return rank
        return rank.model_copy(update={"started": True, "pid": event.data.pid, "started_at": event.time})
    if isinstance(event, RendezvousDone):
        return rank if rank.rendezvous else rank.model_copy(update={"rendezvous": True})
    return rank if rank.ready else rank.model_copy(update={"ready": True})


def _placed_rank(view: JobView, attempt: Attempt, event: Event) -> int:
    rank = _rank(event)
    if rank not in attempt.ranks:
        raise IllegalTransitionError(
            f"{event.type} for rank {rank}, which attempt {attempt.number} of job {view.job_id} did not place"
        )
    placed_on = attempt.ranks[rank].node
    if event.node is not None and event.node != placed_on:
        # A node agent speaks only for its own node (consumers check that it signed as that node); this checks
        # the node is the one the rank runs on, so no agent can end another node's rank.
        raise IllegalTransitionError(
            f"{event.type} for rank {rank} from {event.node}, but attempt {attempt.number} placed it on {placed_on}"
        )
    return rank


def _exit_cause(rank: RankProcess, event: RankExited, *, cancelling: bool) -> tuple[FailureCause, str]:
    where = f"rank {rank.rank} on {rank.node}"
    if event.data.start_error is not None:
        return FailureCause.PLATFORM_ACTION, f"{where} could not be started: {event.data.start_error}"
    if event.data.lost is not None:
        return FailureCause.PLATFORM_ACTION, f"{where} was lost by its agent: {event.data.lost}"
    if event.data.killed_after_grace_s is not None:
        # The agent stopped the gang and enforced it: the stop is the cause (as a plain SIGTERM would be).
        how = f"{where} ignored SIGTERM and was killed after {event.data.killed_after_grace_s:g} s"
        return (FailureCause.USER_CANCEL if cancelling else FailureCause.PLATFORM_ACTION), how
    if event.data.signal is not None:
        how = f"{where} was killed by signal {event.data.signal}"
        if cancelling:
            return FailureCause.USER_CANCEL, how
        if event.data.signal in _NODE_SIGNALS:
            return FailureCause.NODE_FAULT, how
        if event.data.signal in _PLATFORM_SIGNALS:
            return FailureCause.PLATFORM_ACTION, how
        return FailureCause.USER_CODE_ERROR, how
    return FailureCause.USER_CODE_ERROR, f"{where} exited with code {event.data.exit_code}"


def _lane_of(cause: FailureCause | None) -> str:
    lanes = {
        FailureCause.USER_CODE_ERROR: "algorithm",
        FailureCause.USER_CANCEL: "algorithm",
        FailureCause.NODE_FAULT: "host",
        FailureCause.COMMUNICATION_FAILURE: "network",
    }
    return lanes.get(cause, "platform") if cause is not None else "platform"


def _cancel_detail(view: JobView) -> str:
    span = next((s for s in reversed(view.history) if s.state is JobState.CANCELLING), None)
    return span.reason if span else "cancelled"


def _require(view: JobView, event: Event, allowed: set[JobState] | frozenset[JobState]) -> None:
    if view.state not in allowed:
        raise IllegalTransitionError(f"{event.type} is not allowed for job {view.job_id} in state {view.state}")


def _require_not_succeeded(view: JobView, event: Event) -> None:
    if view.current.state is JobState.SUCCEEDED or view.current.cause is FailureCause.NORMAL_COMPLETION:
        raise IllegalTransitionError(f"{event.type}: attempt {view.current.number} of job {view.job_id} succeeded")


def _rank(event: Event) -> int:
    if event.rank is None:
        raise IllegalTransitionError(f"{event.type} for job {event.jobid} has no rank")
    return event.rank


def _replace_current(view: JobView, attempt: Attempt) -> JobView:
    return view.model_copy(update={"attempts": (*view.attempts[:-1], attempt)})


def _end(
    view: JobView, event: Event, attempt: Attempt, to_state: JobState, *, cause: FailureCause | None, detail: str
) -> tuple[JobView, Transition]:
    cause = cause or FailureCause.UNKNOWN
    ended = attempt.model_copy(
        update={
            "ended_at": attempt.ended_at or event.time,
            "cause": cause,
            "cause_detail": detail,
            "cause_event_id": attempt.cause_event_id if attempt.cause is not None else event.id,
        }
    )
    ended = _refined(ended)
    after, transition = _move(view, event, ended, to_state, ended.cause_detail or detail)
    return after, transition.model_copy(update={"cause": ended.cause})


_FINDING_CAUSES = {
    Lane.ALGORITHM: FailureCause.USER_CODE_ERROR,
    Lane.HOST: FailureCause.NODE_FAULT,
    Lane.NETWORK: FailureCause.COMMUNICATION_FAILURE,
    Lane.PLATFORM: FailureCause.PLATFORM_ACTION,
}
"""The cause a telemetry finding names, by the lane of its elected first error."""
_EXPLAINS_NOTHING = frozenset({"unexplained_exit"})
"""First errors that only repeat an exit status (telemetry found nothing that says why): the exits' cause stands."""
_NOT_REFINED = frozenset({FailureCause.NORMAL_COMPLETION, FailureCause.USER_CANCEL})


def _with_finding(attempt: Attempt, event: JobFinding) -> Attempt:
    """Record telemetry's first-error finding for the attempt; a later version supersedes an earlier one."""
    if attempt.finding_version is not None and event.data.version <= attempt.finding_version:
        return attempt
    first = event.data.first_error
    found = {
        "finding_version": event.data.version,
        "finding_event_id": event.id,
        "finding_cause": _FINDING_CAUSES[first.lane] if first and first.category not in _EXPLAINS_NOTHING else None,
        "finding_summary": (first.summary or first.category) if first else None,
    }
    return _refined(attempt.model_copy(update=found))


def _refined(attempt: Attempt) -> Attempt:
    """An ended failed attempt whose cause the finding refines (the exits' cause is kept beside it).

    The same whether the finding arrives before or after the attempt ends. A user cancel or a success is
    never refined: those causes are facts, not inferences.
    """
    if attempt.finding_cause is None or attempt.ended_at is None:
        return attempt
    if attempt.cause is None or attempt.cause in _NOT_REFINED:
        return attempt
    exit_cause = attempt.exit_cause or attempt.cause
    exit_detail = attempt.exit_detail if attempt.exit_cause else attempt.cause_detail
    detail = f"{attempt.finding_summary} (telemetry finding v{attempt.finding_version}; exits: {exit_detail})"
    update = {"exit_cause": exit_cause, "exit_detail": exit_detail, "cause": attempt.finding_cause}
    return attempt.model_copy(update=update | {"cause_detail": detail})


def _move(view: JobView, event: Event, attempt: Attempt, to_state: JobState, reason: str) -> tuple[JobView, Transition]:
    moved = attempt.model_copy(update={"state": to_state})
    span = StateSpan(
        state=to_state,
        entered_at=event.time,
        attempt=moved.number,
        cause_type=event.type,
        cause_id=event.id,
        reason=reason,
    )
    after = _replace_current(view, moved).model_copy(update={"state": to_state, "history": (*view.history, span)})
    transition = Transition(from_state=view.state, to_state=to_state, reason=reason, sequence=len(after.history))
    return after, transition
