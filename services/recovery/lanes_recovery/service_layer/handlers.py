"""Recovery's handler and timers: fold a job event into what recovery knows, decide, publish the actions.

Everything happens inside one PostgreSQL transaction holding the job's row lock (the consumer's, or the
timer runner's), and every event it returns goes through the outbox, so a crash anywhere yields exactly
one decision per failed attempt: the decision is recorded in the knowledge (and in `recovery_decisions`,
whose unique index refuses a second policy decision for an attempt) in the same commit as the outbox rows
that publish it. Derived ids hang on the state change that ended the attempt, so even a decision re-made
after a lost commit carries the same id and JetStream keeps one copy.

A new attempt is requested only once the failed attempt's `resources_released` was folded in (and its
backoff has passed): when the release comes after the decision, the decision is published first and the
`retry_requested` follows when the release arrives (or the backoff timer fires).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

import structlog

from lanes_contract.events import (
    CancelRequested,
    CommandData,
    Event,
    HoldRequested,
    HoldRequestedData,
    ManualActionRequested,
    NodeStateChanged,
    NodeStateChangedData,
    RecoveryDecided,
    RecoveryEscalated,
    RecoveryEscalatedData,
    ReplicaState,
    ReplicaStateChanged,
    ReplicaStateChangedData,
    ResumeRequested,
    RetryData,
    RetryRequested,
    TransitionRejected,
    TransitionRejectedData,
    utc_now,
)
from lanes_contract.ids import derived_event_id
from lanes_contract.topology import NodeState
from lanes_recovery.adapters import repository
from lanes_recovery.adapters.digests import verify_all
from lanes_recovery.domain.checkpoints import DigestVerdict, Verified, verify_checkpoints
from lanes_recovery.domain.decisions import (
    RECOVERY,
    Plan,
    Refusal,
    decide_failure,
    decide_manual,
    spec_is_training,
)
from lanes_recovery.domain.knowledge import DecisionRecord, JobKnowledge, SavedCheckpoint, fold
from lanes_recovery.domain.policy import Policy
from lanes_runtime.consumer import HandlerContext
from lanes_runtime.store import Db

SOURCE = RECOVERY
log = structlog.get_logger(__name__)
_E = TypeVar("_E", bound=Event)

DigestCheck = Callable[[Sequence[SavedCheckpoint]], Awaitable[Mapping[tuple[str, str], DigestVerdict]]]


def _type_of(cls: type[Event]) -> str:
    return str(cls.model_fields["type"].default)


class Recovery:
    """The recovery service's logic around the pure domain: one instance per process, shared by its entrypoints."""

    def __init__(
        self,
        policy: Callable[[], Policy],
        *,
        check_digests: DigestCheck = verify_all,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self._load_policy = policy
        self._policy: Policy | None = None
        self._check_digests = check_digests
        self._clock = clock

    @property
    def policy(self) -> Policy:
        """The policy in force (loaded and validated on first use; the runner loads it at start-up)."""
        if self._policy is None:
            self._policy = self._load_policy()
            log.info("recovery policy loaded", policy=self._policy.name, version=self._policy.version)
        return self._policy

    @property
    def grace(self) -> timedelta:
        """How long a failed attempt waits for a finding that names a first error."""
        return timedelta(seconds=self.policy.defaults.finding_grace_s)

    def now(self) -> datetime:
        """The current time, as recovery's timers see it."""
        return self._clock()

    async def handle_job_event(self, event: Event, ctx: HandlerContext) -> Sequence[Event]:
        """Fold one job event; decide, carry out a manual action, or publish a retry now owed."""
        job_id = event.job_key
        await repository.lock_new(ctx.conn, job_id)
        known = fold(await repository.load(ctx.conn, job_id), event)
        outputs: list[Event] = []
        if isinstance(event, ManualActionRequested):
            known, outputs = await self._manual(ctx.conn, known, event)
        known, more = await self._advance(ctx.conn, known, self.now())
        await repository.save(ctx.conn, known, known.next_due_at(self.grace))
        return [*outputs, *more]

    async def on_timer(self, conn: Db, job_id: str, now: datetime) -> Sequence[Event]:
        """Fire the due timers of one job (a finding's grace, a retry's backoff, a manual deadline)."""
        known = await repository.claim_due(conn, job_id, now)
        if known is None:
            return ()  # another recovery process holds it, or an event already moved it on
        known, outputs = await self._advance(conn, known, now)
        await repository.save(conn, known, known.next_due_at(self.grace))
        return outputs

    # --- decisions -------------------------------------------------------------------------------

    async def _advance(self, conn: Db, known: JobKnowledge, now: datetime) -> tuple[JobKnowledge, list[Event]]:
        outputs: list[Event] = []
        within = timedelta(seconds=self.policy.defaults.decide_within_s)
        for facts in known.stale_failures(now, within):
            log.warning("failure too old to act on; no decision", attempt=facts.number, ended_at=facts.ended_at)
            skipped = f"failed at {facts.ended_at}, more than {within} before recovery saw it"
            known = known.with_attempt(facts.model_copy(update={"decided": True, "skipped": skipped}))
        if known.spec is not None:
            for facts, _without_finding in known.awaiting_decision(now, self.grace):
                verified = await self._verified(known)
                decision_id = derived_event_id(str(facts.ended_by), _type_of(RecoveryDecided), "decision")
                plan = decide_failure(known, facts, self.policy, verified, now=now, decision_id=decision_id)
                known = known.with_attempt(facts.model_copy(update={"decided": True}))
                known, published = await self._carry_out(conn, known, plan, decision_id, facts.number, now)
                outputs.extend(published)
        known, hold = self._owed_hold(known)
        outputs.extend(hold)
        known, retry = self._owed_retry(known, now)
        outputs.extend(retry)
        known, escalation = await self._escalation(conn, known, now)
        outputs.extend(escalation)
        return known, outputs

    async def _verified(self, known: JobKnowledge) -> Verified:
        assert known.spec is not None  # noqa: S101 - callers decide only for jobs whose spec is known
        if not spec_is_training(known.spec):
            return Verified((), ())  # no checkpoint logic outside training: nothing to hash
        digests = await self._check_digests(known.checkpoints)
        return verify_checkpoints(
            known.checkpoints,
            known.spec,
            known.attempts,
            digests,
            unrecorded_versions=self.policy.defaults.unrecorded_versions,
        )

    async def _manual(
        self, conn: Db, known: JobKnowledge, event: ManualActionRequested
    ) -> tuple[JobKnowledge, list[Event]]:
        outcome: Plan | Refusal
        if known.spec is None:
            outcome = Refusal(f"job {known.job_id}: recovery has not seen its submission")
        else:
            outcome = decide_manual(
                known,
                event.data.action,
                requested_by=event.data.requested_by,
                why=event.data.reason,
                policy=self.policy,
                verified=await self._verified(known),
                now=self.now(),
                decision_id=derived_event_id(event.id, _type_of(RecoveryDecided), "decision"),
            )
        if isinstance(outcome, Refusal):
            log.info("manual action refused", reason=outcome.reason, action=event.data.action)
            data = TransitionRejectedData(
                event_type=event.type, event_id=event.id, state=None, reason=f"recovery: {outcome.reason}"
            )
            latest = event.attempt or max(known.attempts, default=None)  # every event joins by attempt
            return known, [_derived(TransitionRejected, known, event.id, attempt=latest, data=data)]
        wait = known.manual
        assert wait is not None  # noqa: S101 - decide_manual refuses when nothing waits
        decision_id = derived_event_id(event.id, _type_of(RecoveryDecided), "decision")
        known = known.model_copy(update={"manual": None})
        return await self._carry_out(conn, known, outcome, decision_id, wait.attempt, self.now(), cause=event.id)

    async def _carry_out(  # noqa: PLR0917 - the decision and where it sits, passed through as one call
        self,
        conn: Db,
        known: JobKnowledge,
        plan: Plan,
        decision_id: str,
        attempt: int,
        now: datetime,
        *,
        cause: str | None = None,
    ) -> tuple[JobKnowledge, list[Event]]:
        """Publish the decision, then the actions it takes; remember what recovery now owes or waits on."""
        data = plan.decision
        decided = _derived(
            RecoveryDecided,
            known,
            cause or data.finding_id,
            attempt=attempt,
            event_id=decision_id,
            time=now,
            data=data,
        )
        await repository.record_decision(conn, decided)
        outputs: list[Event] = [decided]
        for cordon in plan.cordons:
            node_data = NodeStateChangedData(state=NodeState.CORDONED, reason=cordon.reason)
            outputs.append(
                _derived(
                    NodeStateChanged, known, decision_id, key=cordon.node, attempt=attempt, node=cordon.node,
                    lane=cordon.lane, data=node_data,
                )
            )  # fmt: skip
        if plan.replica_out is not None:
            replica = ReplicaStateChangedData(
                replica=known.job_id,
                model=plan.replica_out.model,
                version=plan.replica_out.version,
                state=ReplicaState.UNHEALTHY,
                reason=plan.replica_out.reason,
                signal="recovery",
            )
            outputs.append(_derived(ReplicaStateChanged, known, decision_id, attempt=attempt, data=replica))
        if plan.abandon:
            command = CommandData(reason=data.reason, requested_by=data.requested_by or SOURCE)
            outputs.append(_derived(CancelRequested, known, decision_id, attempt=attempt, data=command))
        facts = known.attempt(attempt)
        first_error = facts.finding.first_error if facts.finding else None
        record = DecisionRecord(
            id=decision_id,
            attempt=attempt,
            action=data.action,
            first_error=data.first_error,
            node=first_error.node if first_error else None,
            resumed_from=facts.resumed_from or 0,
            resume_step=data.resume_step,
            finding_id=data.finding_id,
            decided_at=now,
            manual=data.manual_action is not None,
        )
        update: dict[str, Any] = {"decisions": (*known.decisions, record)}
        if plan.hold is not None:
            update["manual"] = plan.hold
        if plan.retry is not None:
            update["pending"] = plan.retry
        if known.spec is not None and known.spec.managed_by is not None:
            # An observed job: another system (e.g. Slurm) acts on it. Recovery publishes its decision and
            # still escalates a wait nobody answers, but sends no cordon, retry, cancel or hold.
            update.pop("pending", None)
            if plan.hold is not None:
                update["manual"] = plan.hold.model_copy(update={"held": True})
            outputs = [decided]
        log.info("recovery decided", action=data.action, attempt=attempt, first_error=data.first_error)
        return known.model_copy(update=update), outputs

    def _owed_hold(self, known: JobKnowledge) -> tuple[JobKnowledge, list[Event]]:
        """The hold of a manual decision, once the attempt's resources are released (or it never held any).

        Waiting keeps the job's story in one order, failed -> released -> awaiting_manual, and the owner
        decides about a job that no longer holds GPUs.
        """
        wait = known.manual
        if wait is None or wait.held:
            return known, []
        facts = known.attempt(wait.attempt)
        if facts.placed and not facts.released:
            return known, []
        data = HoldRequestedData(reason=wait.reason, requested_by=SOURCE, owner=wait.owner, deadline=wait.deadline)
        hold = _derived(HoldRequested, known, wait.decision_id, attempt=wait.attempt, data=data)
        return known.model_copy(update={"manual": wait.model_copy(update={"held": True})}), [hold]

    def _owed_retry(self, known: JobKnowledge, now: datetime) -> tuple[JobKnowledge, list[Event]]:
        """The new attempt recovery owes, once the failed attempt's resources are released and backoff passed."""
        pending = known.pending
        if pending is None or not known.attempt(pending.attempt).released or pending.due_at > now:
            return known, []
        data = RetryData(
            reason=pending.reason,
            requested_by=pending.requested_by,
            resume_step=pending.resume_step,
            avoid_nodes=pending.avoid_nodes,
        )
        command: type[RetryRequested | ResumeRequested] = (
            RetryRequested if pending.command == "retry" else ResumeRequested
        )
        request = _derived(command, known, pending.decision_id, attempt=pending.attempt, data=data)
        return known.model_copy(update={"pending": None}), [request]

    async def _escalation(self, conn: Db, known: JobKnowledge, now: datetime) -> tuple[JobKnowledge, list[Event]]:
        wait = known.manual
        if wait is None or wait.escalated or wait.deadline > now:
            return known, []
        data = RecoveryEscalatedData(
            decision_id=wait.decision_id,
            owner=wait.owner,
            owner_lane=wait.owner_lane,
            deadline=wait.deadline,
            reason=f"nobody decided by {wait.deadline.isoformat()}: {wait.reason}",
        )
        await repository.mark_escalated(conn, wait.decision_id, now)
        escalated = _derived(RecoveryEscalated, known, wait.decision_id, attempt=wait.attempt, data=data)
        return known.model_copy(update={"manual": wait.model_copy(update={"escalated": True})}), [escalated]


def _derived(
    event_class: type[_E],
    known: JobKnowledge,
    cause_id: str,
    *,
    key: str = "",
    attempt: int | None,
    event_id: str | None = None,
    **fields: Any,
) -> _E:
    """An event recovery derives from `cause_id`: a deterministic id, the job's join keys and correlation."""
    return event_class(
        id=event_id or derived_event_id(cause_id, _type_of(event_class), key),
        source=SOURCE,
        jobid=known.job_id,
        attempt=attempt,
        causationid=cause_id,
        correlationid=known.correlation_id,
        **fields,
    )
