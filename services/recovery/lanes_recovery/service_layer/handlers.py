"""Recovery's handler and timers: fold a job event into what recovery knows, decide, publish the actions.

Everything happens inside one PostgreSQL transaction holding the job's row lock (the consumer's, or the
timer runner's), and every event it returns goes through the outbox, so a crash anywhere yields exactly
one decision per failed attempt: the decision is recorded in the knowledge (and in `recovery_decisions`,
whose unique index refuses a second policy decision for an attempt) in the same commit as the outbox rows
that publish it. Derived ids hang on the state change that ended the attempt, so even a decision re-made
after a lost commit carries the same id and JetStream keeps one copy.

Recovery decides on a settled finding (or, when its grace runs out, on what it has, and says so). A later
settled finding that blames someone else supersedes the decision (`domain/supersede.py`): re-planned while
the next attempt is not placed (uncordon the wrong node, cordon the right one, a new decision), escalated to
the owner of the culprit's lane once it is.

A new attempt is requested only once the failed attempt's `resources_released` was folded in (and its
backoff has passed): when the release comes after the decision, the decision is published first and the
`retry_requested` follows when the release arrives (or the backoff timer fires).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import structlog

from lanes_contract.events import (
    CancelRequested,
    CommandData,
    Culprit,
    Event,
    HoldRequested,
    HoldRequestedData,
    ManualActionRequested,
    NodeStateChanged,
    NodeStateChangedData,
    RecoveryDecided,
    RecoveryEscalated,
    RecoveryEscalatedData,
    RecoverySuperseded,
    RecoverySupersededData,
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
from lanes_recovery.adapters.digests import BackgroundDigests, DigestLimits
from lanes_recovery.adapters.repository import PostgresRecoveryStore
from lanes_recovery.domain.checkpoints import DigestVerdict, Verified, verify_checkpoints
from lanes_recovery.domain.decisions import (
    RECOVERY,
    Plan,
    Refusal,
    assumed_first_error,
    decide_failure,
    decide_manual,
    owner_of,
    spec_is_training,
)
from lanes_recovery.domain.knowledge import DecisionRecord, FirstError, JobKnowledge, fold
from lanes_recovery.domain.policy import Policy
from lanes_recovery.domain.slowdowns import decide_slowdown
from lanes_recovery.domain.supersede import Supersession, superseded
from lanes_recovery.service_layer.ports import Digests, RecoveryStore, StoreFactory
from lanes_runtime.consumer import HandlerContext
from lanes_runtime.store import Db

SOURCE = RECOVERY
DIGEST_RECHECK = timedelta(milliseconds=100)
"""How soon a decision waiting for its checkpoint digests looks again (the timer's tick bounds it too)."""
log = structlog.get_logger(__name__)
_E = TypeVar("_E", bound=Event)


def _type_of(cls: type[Event]) -> str:
    return str(cls.model_fields["type"].default)


class Recovery:
    """The recovery service's logic around the pure domain: one instance per process, shared by its entrypoints."""

    def __init__(
        self,
        policy: Callable[[], Policy],
        *,
        digests: Digests | None = None,
        clock: Callable[[], datetime] = utc_now,
        store: StoreFactory = PostgresRecoveryStore,
    ) -> None:
        self._store = store
        self._given_digests = digests
        self._load_policy = policy
        self._policy: Policy | None = None
        self._clock = clock

    @property
    def policy(self) -> Policy:
        """The policy in force (loaded and validated on first use; the runner loads it at start-up)."""
        if self._policy is None:
            self._policy = self._load_policy()
            log.info("recovery policy loaded", policy=self._policy.name, version=self._policy.version)
        return self._policy

    @property
    def digests(self) -> Digests:
        """The digest checker: the one given, else background digests under the policy's roots and limits."""
        if self._given_digests is None:
            d = self.policy.defaults
            roots = tuple(Path(root) for root in d.checkpoint_roots)
            limits = DigestLimits(roots=roots, max_bytes=d.digest_max_bytes, timeout_s=d.digest_timeout_s)
            self._given_digests = BackgroundDigests(limits)
        return self._given_digests

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
        store = self._store(ctx.conn)
        await store.lock_new(job_id)
        known = fold(await store.load(job_id), event)
        outputs: list[Event] = []
        if isinstance(event, ManualActionRequested):
            known, outputs = await self._manual(store, known, event)
        known, more = await self._advance(store, known, self.now())
        await store.save(known, known.next_due_at(self.grace))
        return [*outputs, *more]

    async def on_timer(self, conn: Db, job_id: str, now: datetime) -> Sequence[Event]:
        """Fire the due timers of one job (a finding's grace, a retry's backoff, a manual deadline)."""
        store = self._store(conn)
        known = await store.claim_due(job_id, now)
        if known is None:
            return ()  # another recovery process holds it, or an event already moved it on
        known, outputs = await self._advance(store, known, now)
        await store.save(known, known.next_due_at(self.grace))
        return outputs

    # --- decisions -------------------------------------------------------------------------------

    async def _advance(
        self, store: RecoveryStore, known: JobKnowledge, now: datetime
    ) -> tuple[JobKnowledge, list[Event]]:
        outputs: list[Event] = []
        within = timedelta(seconds=self.policy.defaults.decide_within_s)
        for facts in known.stale_failures(now, within):
            log.warning("failure too old to act on; no decision", attempt=facts.number, ended_at=facts.ended_at)
            skipped = f"failed at {facts.ended_at}, more than {within} before recovery saw it"
            known = known.with_attempt(facts.model_copy(update={"decided": True, "skipped": skipped}))
        known = known.model_copy(update={"recheck_at": None})
        if known.spec is not None and spec_is_training(known.spec) and known.failed_undecided():
            self.digests.start(known.checkpoints)  # hashed while the finding settles, ready when it is
        if known.spec is not None:
            for facts, _without_finding in known.awaiting_decision(now, self.grace):
                verified = self._verified_now(known)
                if verified is None:
                    # Its checkpoints are still being hashed: decide it from the timer, never block the consumer.
                    known = known.model_copy(update={"recheck_at": now + DIGEST_RECHECK})
                    break
                decision_id = derived_event_id(str(facts.ended_by), _type_of(RecoveryDecided), "decision")
                plan = decide_failure(
                    known,
                    facts,
                    self.policy,
                    verified,
                    now=now,
                    decision_id=decision_id,
                    recently_cordoned=await self._recently_cordoned(store, now),
                )
                known = known.with_attempt(facts.model_copy(update={"decided": True}))
                known, published = await self._carry_out(store, known, plan, decision_id, facts.number, now)
                outputs.extend(published)
            known, published = await self._decide_slowdowns(store, known, now)
            outputs.extend(published)
            for supersession in superseded(known):
                known, published = await self._supersede(store, known, supersession, now)
                outputs.extend(published)
        known, hold = self._owed_hold(known)
        outputs.extend(hold)
        known, retry = self._owed_retry(known, now)
        outputs.extend(retry)
        known, escalation = await self._escalation(store, known, now)
        outputs.extend(escalation)
        return known, outputs

    async def _decide_slowdowns(
        self, store: RecoveryStore, known: JobKnowledge, now: datetime
    ) -> tuple[JobKnowledge, list[Event]]:
        """Run on, or restart, each running attempt telemetry found slow (once per attempt)."""
        outputs: list[Event] = []
        for facts in known.slowdowns_to_decide():
            verified = self._verified_now(known)
            if verified is None:  # its checkpoints are still being hashed: decide from the timer
                self.digests.start(known.checkpoints)
                return known.model_copy(update={"recheck_at": now + DIGEST_RECHECK}), outputs
            slow = facts.slowdown
            assert slow is not None  # noqa: S101 - listed because it has one
            decision_id = derived_event_id(slow.id, _type_of(RecoveryDecided), "decision")
            plan = decide_slowdown(
                known,
                facts,
                self.policy,
                verified,
                now=now,
                decision_id=decision_id,
                recently_cordoned=await self._recently_cordoned(store, now),
            )
            known = known.with_attempt(facts.model_copy(update={"slowdown_decided": True}))
            culprit = FirstError(lane=slow.lane, category=slow.kind, node=slow.node, rank=slow.rank)
            known, published = await self._carry_out(
                store, known, plan, decision_id, facts.number, now, culprit=culprit
            )
            outputs.extend(published)
        return known, outputs

    async def _recently_cordoned(self, store: RecoveryStore, now: datetime) -> frozenset[str]:
        """The nodes the cordon budget counts: cordoned by any decision in force within its window."""
        return await store.cordoned_since(now - timedelta(seconds=self.policy.defaults.cordon_budget.window_s))

    def _verified_now(self, known: JobKnowledge) -> Verified | None:
        """The checkpoint gate if every digest is in, else None (the missing ones are being computed)."""
        assert known.spec is not None  # noqa: S101 - callers decide only for jobs whose spec is known
        if not spec_is_training(known.spec):
            return Verified((), ())  # no checkpoint logic outside training: nothing to hash
        digests = self.digests.ready(known.checkpoints)
        return None if digests is None else self._gate(known, digests)

    async def _verified(self, known: JobKnowledge) -> Verified:
        """The checkpoint gate, waiting (bounded) for the digests (an owner's action, a superseded decision)."""
        assert known.spec is not None  # noqa: S101 - callers decide only for jobs whose spec is known
        if not spec_is_training(known.spec):
            return Verified((), ())
        return self._gate(known, await self.digests.wait(known.checkpoints))

    def _gate(self, known: JobKnowledge, digests: Mapping[tuple[str, str], DigestVerdict]) -> Verified:
        assert known.spec is not None  # noqa: S101 - see the callers
        return verify_checkpoints(
            known.checkpoints,
            known.spec,
            known.attempts,
            digests,
            unrecorded_versions=self.policy.defaults.unrecorded_versions,
        )

    async def _supersede(
        self, store: RecoveryStore, known: JobKnowledge, s: Supersession, now: datetime
    ) -> tuple[JobKnowledge, list[Event]]:
        """Re-plan a decision a later settled finding contradicts, or escalate when the next attempt is out."""
        assert known.spec is not None  # noqa: S101 - only decided jobs are superseded, and those have a spec
        attempt = s.decision.attempt
        cause = s.finding.id
        data = RecoverySupersededData(
            decision_id=s.decision.id,
            decided_on=_culprit(s.decided_on),
            decided_version=s.decision.finding_version,
            finding_id=s.finding.id,
            finding_version=s.finding.version,
            culprit=_culprit(s.culprit),
            uncordon=s.uncordon,
            replanned=s.replan,
            reason=s.reason(attempt + 1),
        )
        notice = _derived(RecoverySuperseded, known, cause, attempt=attempt, data=data)
        log.warning("recovery decision superseded", decision=s.decision.id, reason=data.reason)
        if not s.replan:
            owner = owner_of(known.spec, s.culprit.lane)
            escalation = RecoveryEscalatedData(
                decision_id=s.decision.id, owner=owner, owner_lane=s.culprit.lane, deadline=now, reason=data.reason
            )
            escalated = _derived(RecoveryEscalated, known, cause, attempt=attempt, data=escalation)
            await store.mark_escalated(s.decision.id, now)
            return _updated(known, s.decision, escalated=s.culprit), [notice, escalated]
        decision_id = derived_event_id(cause, _type_of(RecoveryDecided), "decision")
        await store.mark_superseded(s.decision.id, decision_id)
        known = _updated(known, s.decision, superseded_by=decision_id).model_copy(
            update={"pending": None, "manual": None}
        )
        facts = known.attempt(attempt)
        facts = facts.model_copy(update={"finding": s.finding, "latest": None})
        known = known.with_attempt(facts)
        outputs: list[Event] = [notice]
        for node in s.uncordon:
            reason = f"uncordoned: {data.reason}"
            ready = NodeStateChangedData(state=NodeState.READY, reason=reason)
            outputs.append(
                _derived(
                    NodeStateChanged, known, notice.id, key=node, attempt=attempt, node=node,
                    lane=s.decided_on.lane, data=ready,
                )
            )  # fmt: skip
        plan = decide_failure(
            known,
            facts,
            self.policy,
            await self._verified(known),
            now=now,
            decision_id=decision_id,
            recently_cordoned=await self._recently_cordoned(store, now),
        )
        known, published = await self._carry_out(store, known, plan, decision_id, attempt, now)
        return known, [*outputs, *published]

    async def _manual(
        self, store: RecoveryStore, known: JobKnowledge, event: ManualActionRequested
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
        return await self._carry_out(store, known, outcome, decision_id, wait.attempt, self.now(), cause=event.id)

    async def _carry_out(  # noqa: PLR0917 - the decision and where it sits, passed through as one call
        self,
        store: RecoveryStore,
        known: JobKnowledge,
        plan: Plan,
        decision_id: str,
        attempt: int,
        now: datetime,
        *,
        cause: str | None = None,
        culprit: FirstError | None = None,
    ) -> tuple[JobKnowledge, list[Event]]:
        """Publish the decision, then the actions it takes; remember what recovery now owes or waits on.

        `culprit`: whom the decision blames, when not the attempt's finding (a slowdown's rank and node).
        """
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
        await store.record_decision(decided)
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
        if plan.abandon or plan.stop is not None:
            command = CommandData(reason=plan.stop or data.reason, requested_by=data.requested_by or SOURCE)
            outputs.append(_derived(CancelRequested, known, decision_id, attempt=attempt, data=command))
        facts = known.attempt(attempt)
        first_error = facts.finding.first_error if facts.finding else None
        if culprit is None:
            culprit = assumed_first_error(facts)
        record = DecisionRecord(
            id=decision_id,
            attempt=attempt,
            action=data.action,
            first_error=data.first_error,
            node=first_error.node if first_error else None,
            culprit=culprit,
            finding_version=data.finding_version,
            cordoned=tuple(c.node for c in plan.cordons),
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

    async def _escalation(
        self, store: RecoveryStore, known: JobKnowledge, now: datetime
    ) -> tuple[JobKnowledge, list[Event]]:
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
        await store.mark_escalated(wait.decision_id, now)
        escalated = _derived(RecoveryEscalated, known, wait.decision_id, attempt=wait.attempt, data=data)
        return known.model_copy(update={"manual": wait.model_copy(update={"escalated": True})}), [escalated]


def _culprit(first: FirstError) -> Culprit:
    return Culprit(lane=first.lane, category=first.category, node=first.node, rank=first.rank)


def _updated(known: JobKnowledge, old: DecisionRecord, **update: Any) -> JobKnowledge:
    """The knowledge with one decision record updated (superseded, or escalated about)."""
    decisions = tuple(d.model_copy(update=update) if d.id == old.id else d for d in known.decisions)
    return known.model_copy(update={"decisions": decisions})


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
