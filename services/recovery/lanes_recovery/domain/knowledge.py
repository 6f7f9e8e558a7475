"""What recovery knows about one job, as a pure fold over the job's events.

Only facts recovery needs are kept: the spec, per attempt its placement, progress (first and last
heartbeat step with their times), how it ended, telemetry's latest finding and whether its allocation was
released; every checkpoint record; and recovery's own decisions, the retry it still owes and the manual
step it waits on. Folding is idempotent per fact (a repeated event changes nothing), so a redelivery is
harmless even before the processed-event record catches it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict

from lanes_contract.events import (
    AttemptRequested,
    CheckpointRef,
    CheckpointSaved,
    Event,
    Heartbeat,
    JobFinding,
    JobPlaced,
    JobSlowdown,
    JobStateChanged,
    JobSubmitted,
    Lane,
    RecoveryAction,
    ResourcesReleased,
)
from lanes_contract.jobs import FailureCause, JobSpec, JobState


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FirstError(_Frozen):
    """The first error a finding elected (or the one recovery assumed for want of a finding)."""

    lane: Lane
    category: str
    node: str | None = None
    rank: int | None = None
    summary: str = ""

    @property
    def label(self) -> str:
        """`lane/category`, e.g. host/oom_kill: what policies match and crash loops compare."""
        return f"{self.lane.value}/{self.category}"

    @property
    def named(self) -> str:
        """`host/oom_kill on node-3 rank 2`: the culprit as people read it."""
        where = " ".join(p for p in (self.node or "", f"rank {self.rank}" if self.rank is not None else "") if p)
        return f"{self.label} on {where}" if where else self.label

    def blames_other_than(self, other: FirstError) -> bool:
        """Whether this culprit moved from `other`: another lane or node, or another rank where both name one."""
        if (self.lane, self.node) != (other.lane, other.node):
            return True
        return self.rank is not None and other.rank is not None and self.rank != other.rank


class FindingSeen(_Frozen):
    """Telemetry's latest finding for an attempt."""

    id: str
    version: int
    first_error: FirstError | None
    settled: bool = False
    """Whether telemetry said the finding is settled (every rank and node accounted for, or its window ended)."""


class SlowdownSeen(_Frozen):
    """Telemetry's first slowdown of a running attempt: what kind, whose, how much, since when."""

    id: str
    lane: Lane
    kind: str
    rank: int | None = None
    node: str | None = None
    onset_step: int
    slowdown: float
    summary: str = ""


class SavedCheckpoint(_Frozen):
    """A `checkpoint_saved` record, with everything the version gate checks."""

    attempt: int
    rank: int | None
    step: int
    path: str
    digest: str
    model_version: str | None = None
    data_version: str | None = None
    config_version: str | None = None
    image: str | None = None
    saved_at: datetime

    def ref(self) -> CheckpointRef:
        """The checkpoint as decisions name it."""
        return CheckpointRef(attempt=self.attempt, step=self.step, path=self.path, digest=self.digest)


class AttemptFacts(_Frozen):
    """One attempt as recovery sees it."""

    number: int
    nodes: tuple[str, ...] = ()
    gpus: int = 0
    placed: bool = False
    resumed_from: int | None = None
    """The step the lifecycle started this attempt from (None: the start, or unknown for attempt 1)."""
    first_step: int | None = None
    first_step_at: datetime | None = None
    last_step: int | None = None
    last_step_at: datetime | None = None
    outcome: Literal["failed", "succeeded", "cancelled"] | None = None
    ended_at: datetime | None = None
    ended_by: str | None = None
    """The id of the state change that ended the attempt: what derived ids of its decision hang on."""
    end_cause: FailureCause | None = None
    finding: FindingSeen | None = None
    released: bool = False
    decided: bool = False
    skipped: str | None = None
    """Why the attempt got no decision although it failed (e.g. too old when recovery first saw it)."""
    findings_after_decision: tuple[int, ...] = ()
    """Finding versions that arrived after the decision."""
    latest: FindingSeen | None = None
    """The latest finding once the attempt was decided: a settled one that moves the culprit supersedes."""
    slowdown: SlowdownSeen | None = None
    slowdown_decided: bool = False
    """Whether recovery decided about the slowdown (run on, or restart): once per attempt."""

    @property
    def step_time_s(self) -> float | None:
        """Seconds per step, from the first and last heartbeat of the attempt."""
        first, last = self.first_step, self.last_step
        if first is None or last is None or self.first_step_at is None or self.last_step_at is None or last <= first:
            return None
        return max((self.last_step_at - self.first_step_at).total_seconds(), 0.0) / (last - first)


class DecisionRecord(_Frozen):
    """A decision recovery published, kept for crash-loop detection and the manual path."""

    id: str
    attempt: int
    action: RecoveryAction
    first_error: str
    node: str | None
    resumed_from: int
    """The step the failed attempt had started from: the "same checkpoint" of crash-loop detection."""
    resume_step: int | None
    finding_id: str
    decided_at: datetime
    manual: bool = False
    """A decision an owner made (`lanes recover`), not the policy."""
    culprit: FirstError | None = None
    """Whom the decision blamed (the finding's first error, or what recovery assumed)."""
    finding_version: int | None = None
    cordoned: tuple[str, ...] = ()
    superseded_by: str | None = None
    """The decision that replaced it when a later finding moved the culprit before the next attempt was out."""
    escalated: FirstError | None = None
    """The culprit of the last escalation about it (the next attempt was out when the finding moved)."""


class PendingRetry(_Frozen):
    """A new attempt recovery decided on and still owes: published once the attempt's release is seen."""

    decision_id: str
    attempt: int
    """The failed attempt the retry names (the lifecycle rejects a stale one)."""
    command: Literal["retry", "resume"]
    """`retry` for the policy's own decisions; `resume` for an owner's approval of a held job."""
    resume_step: int | None
    reason: str
    requested_by: str
    due_at: datetime
    avoid_nodes: tuple[str, ...] = ()
    """The nodes the decision cordoned: the new attempt must not be placed on them (whatever the scheduler has
    heard of the cordon by then)."""
    restart: bool = False
    """Owed after recovery stopped a running attempt (a slow one): its cancel does not void the retry."""


class ManualWait(_Frozen):
    """The manual step recovery waits on: who decides, by when, and whether it was escalated."""

    decision_id: str
    attempt: int
    owner: str
    owner_lane: Lane
    deadline: datetime
    reason: str
    finding_id: str
    held: bool = False
    """Whether the `hold_requested` went out (it waits for the attempt's release, like a retry)."""
    escalated: bool = False


class JobKnowledge(_Frozen):
    """Everything recovery knows about one job."""

    job_id: str
    spec: JobSpec | None = None
    correlation_id: str | None = None
    attempts: dict[int, AttemptFacts] = {}
    checkpoints: tuple[SavedCheckpoint, ...] = ()
    decisions: tuple[DecisionRecord, ...] = ()
    pending: PendingRetry | None = None
    manual: ManualWait | None = None
    recheck_at: datetime | None = None
    """When to look again at a decision that waits for checkpoint digests still being computed."""

    def attempt(self, number: int) -> AttemptFacts:
        """The facts of attempt `number` (empty when nothing is known yet)."""
        return self.attempts.get(number) or AttemptFacts(number=number)

    def with_attempt(self, facts: AttemptFacts) -> JobKnowledge:
        """This knowledge with one attempt's facts replaced."""
        return self.model_copy(update={"attempts": self.attempts | {facts.number: facts}})

    def awaiting_decision(self, now: datetime, grace: timedelta) -> list[tuple[AttemptFacts, bool]]:
        """Failed attempts to decide now, each with whether it is decided without a finding (grace expired).

        An attempt is decided as soon as it failed and its finding is settled; one that was never placed is
        decided at once (no evidence can come); otherwise it waits `grace` for a settled finding, and then
        decides on whatever finding it has (the decision says so).
        """
        ready = []
        for facts in sorted(self.attempts.values(), key=lambda a: a.number):
            if facts.outcome != "failed" or facts.decided or facts.ended_at is None:
                continue
            if not facts.placed or (facts.finding is not None and facts.finding.settled):
                ready.append((facts, False))
            elif facts.ended_at + grace <= now:
                ready.append((facts, True))
        return ready

    def slowdowns_to_decide(self) -> list[AttemptFacts]:
        """Running attempts with a slowdown recovery has not decided about (an ended one has nothing to restart)."""
        return [
            facts
            for facts in sorted(self.attempts.values(), key=lambda a: a.number)
            if facts.slowdown is not None and not facts.slowdown_decided and facts.outcome is None
        ]

    def failed_undecided(self) -> bool:
        """Whether an attempt failed and awaits its decision."""
        return any(f.outcome == "failed" and not f.decided for f in self.attempts.values())

    def stale_failures(self, now: datetime, within: timedelta) -> list[AttemptFacts]:
        """Undecided failures older than `within`: recovery deployed on an existing log must not act on history."""
        return [
            facts
            for facts in self.attempts.values()
            if facts.outcome == "failed" and not facts.decided and facts.ended_at is not None
            and facts.ended_at + within < now
        ]  # fmt: skip

    def next_due_at(self, grace: timedelta) -> datetime | None:
        """When a timer of this job fires next: a finding's grace, a retry's backoff, a manual deadline."""
        moments = [
            facts.ended_at + grace
            for facts in self.attempts.values()
            if facts.outcome == "failed" and not facts.decided and facts.ended_at is not None
        ]
        if self.pending is not None and self.attempt(self.pending.attempt).released:
            moments.append(self.pending.due_at)
        if self.manual is not None and not self.manual.escalated:
            moments.append(self.manual.deadline)
        if self.recheck_at is not None:
            moments.append(self.recheck_at)
        return min(moments, default=None)


def fold(knowledge: JobKnowledge | None, event: Event) -> JobKnowledge:
    """Apply one job event to what recovery knows (events recovery does not use leave it unchanged)."""
    job_id = event.job_key
    known = knowledge or JobKnowledge(job_id=job_id)
    number = event.attempt or 1
    facts = known.attempt(number)
    if isinstance(event, JobSubmitted):
        if known.spec is not None:
            return known
        return known.model_copy(update={"spec": event.data.spec, "correlation_id": event.correlationid or event.id})
    if isinstance(event, JobPlaced):
        gpus = sum(len(a.gpus) for a in event.data.assignments)
        return known.with_attempt(facts.model_copy(update={"nodes": event.data.nodes, "gpus": gpus, "placed": True}))
    if isinstance(event, AttemptRequested):
        return known.with_attempt(facts.model_copy(update={"resumed_from": event.data.resume_step}))
    if isinstance(event, Heartbeat):
        return known.with_attempt(_progress(facts, event.data.step, event.time))
    if isinstance(event, CheckpointSaved):
        return _checkpoint(known, event)
    if isinstance(event, JobFinding):
        return known.with_attempt(_finding(facts, event))
    if isinstance(event, JobSlowdown):
        return known if facts.slowdown is not None else known.with_attempt(_slowdown(facts, event))
    if isinstance(event, ResourcesReleased):
        return known.with_attempt(facts.model_copy(update={"released": True}))
    if isinstance(event, JobStateChanged):
        return _state_changed(known, facts, event)
    return known


def _progress(facts: AttemptFacts, step: int, at: datetime) -> AttemptFacts:
    update: dict[str, object] = {}
    if facts.first_step is None or step < facts.first_step:
        update |= {"first_step": step, "first_step_at": at}
    if facts.last_step is None or step > facts.last_step:
        update |= {"last_step": step, "last_step_at": at}
    return facts.model_copy(update=update) if update else facts


def _checkpoint(known: JobKnowledge, event: CheckpointSaved) -> JobKnowledge:
    data = event.data
    saved = SavedCheckpoint(
        attempt=event.attempt or 1,
        rank=event.rank,
        step=data.step,
        path=data.path,
        digest=data.digest,
        model_version=data.model_version,
        data_version=data.data_version,
        config_version=data.config_version,
        image=data.image,
        saved_at=event.time,
    )
    if any(c.model_copy(update={"saved_at": saved.saved_at}) == saved for c in known.checkpoints):
        return known  # the same record again (a re-sent event with a new id)
    return known.model_copy(update={"checkpoints": (*known.checkpoints, saved)})


def _slowdown(facts: AttemptFacts, event: JobSlowdown) -> AttemptFacts:
    data = event.data
    seen = SlowdownSeen(
        id=event.id,
        lane=event.lane,
        kind=data.kind,
        rank=data.rank,
        node=data.node,
        onset_step=data.onset_step,
        slowdown=data.slowdown,
        summary=data.summary,
    )
    return facts.model_copy(update={"slowdown": seen})


def _finding(facts: AttemptFacts, event: JobFinding) -> AttemptFacts:
    if facts.finding is not None and event.data.version <= facts.finding.version:
        return facts
    first = event.data.first_error
    first_error = (
        None
        if first is None
        else FirstError(
            lane=first.lane, category=first.category, node=first.node, rank=first.rank, summary=first.summary
        )
    )
    seen = FindingSeen(id=event.id, version=event.data.version, first_error=first_error, settled=event.data.settled)
    if facts.decided:
        # The decision stands on the finding known then; a later version is kept, and a settled one that moves
        # the culprit supersedes the decision (see `supersede.py`).
        if facts.latest is not None and event.data.version <= facts.latest.version:
            return facts
        return facts.model_copy(
            update={"findings_after_decision": (*facts.findings_after_decision, event.data.version), "latest": seen}
        )
    return facts.model_copy(update={"finding": seen})


def _state_changed(known: JobKnowledge, facts: AttemptFacts, event: JobStateChanged) -> JobKnowledge:
    to_state = event.data.to_state
    ended = {
        JobState.FAILED: "failed",
        JobState.SUCCEEDED: "succeeded",
        JobState.CANCELLED: "cancelled",
    }.get(to_state)
    restarting = known.pending is not None and known.pending.restart and known.pending.attempt == facts.number
    if to_state is JobState.RETRYING or (to_state is JobState.CANCELLED and not restarting):
        # The job moved on (a new attempt, or abandoned): whatever recovery still owed for it is void. Not so
        # the attempt recovery stopped itself to restart it: its cancel is the first half of the restart.
        known = known.model_copy(update={"manual": None, "pending": None})
    if ended is None or facts.outcome is not None:
        return known
    return known.with_attempt(
        facts.model_copy(
            update={"outcome": ended, "ended_at": event.time, "ended_by": event.id, "end_cause": event.data.cause}
        )
    )
