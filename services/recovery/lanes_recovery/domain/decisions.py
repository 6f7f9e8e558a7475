"""Recovery decisions: what to do about a failed attempt, and about an owner's manual action. Pure.

`decide_failure` applies the policy rule for the attempt's first error, then the guards that make a
failure non-recoverable whatever the rule says: retry budget spent, crash loop (the same first error on
the same node, or from the same checkpoint, `crash_loop_count` times), for training a checkpoint gate
that refused every recorded checkpoint (a version mismatch), and the cordon budget: a decision that would
cordon one node more than the policy allows within its window waits for a person instead. It returns a
`Plan`: the decision's data and the actions that go with it (cordon, replica out of rotation, hold, the
retry still owed).

A node is cordoned only on host or network evidence about it: a first error that is only an exit status or
a signal, an unexplained exit or a hang everyone waited in (`NO_NODE_EVIDENCE`) cordons nothing, whatever
the rule says, and the decision says so.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from lanes_contract.events import (
    Culprit,
    Lane,
    LostWork,
    ManualAction,
    RecoveryAction,
    RecoveryDecidedData,
)
from lanes_contract.ids import is_valid_token
from lanes_contract.jobs import JobSpec, WorkloadClass
from lanes_recovery.domain.checkpoints import Verified
from lanes_recovery.domain.knowledge import (
    AttemptFacts,
    FirstError,
    JobKnowledge,
    ManualWait,
    PendingRetry,
    SavedCheckpoint,
)
from lanes_recovery.domain.policy import (
    NEVER_PLACED,
    NO_FINDING,
    NO_NODE_EVIDENCE,
    CordonBudget,
    Effective,
    Policy,
    Rule,
)

RECOVERY = "lanes/recovery"
ATTEMPT_REQUESTED = "io.lanes.job.attempt_requested.v1"
MANUAL_ACTION = "io.lanes.job.manual_action.v1"
STATE_CHANGED = "io.lanes.job.state_changed.v1"
_SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Cordon:
    """Take a node out of scheduling: the lane that owns it and why."""

    node: str
    lane: Lane
    reason: str


@dataclass(frozen=True)
class ReplicaOut:
    """Mark an inference replica unhealthy so the router stops sending to it."""

    model: str
    version: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """A decision and everything it sets in motion."""

    decision: RecoveryDecidedData
    cordons: tuple[Cordon, ...] = ()
    replica_out: ReplicaOut | None = None
    hold: ManualWait | None = None
    retry: PendingRetry | None = None
    abandon: bool = False
    stop: str | None = None
    """Stop the running attempt now, for this reason (a slow one restarted elsewhere)."""
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Refusal:
    """A manual action recovery cannot carry out, and why (it goes on the timeline, not into a decision)."""

    reason: str


def assumed_first_error(facts: AttemptFacts) -> FirstError:
    """The finding's first error, or what recovery assumes without one (documented categories)."""
    if facts.finding is not None and facts.finding.first_error is not None:
        return facts.finding.first_error
    if not facts.placed:
        return FirstError(lane=Lane.PLATFORM, category=NEVER_PLACED, summary="the attempt failed before it was placed")
    return FirstError(lane=Lane.PLATFORM, category=NO_FINDING, summary="no finding named a first error in time")


def spec_is_training(spec: JobSpec) -> bool:
    """Whether checkpoint logic applies: only training resumes from checkpoints."""
    return spec.workload_class is WorkloadClass.TRAINING


def owner_of(spec: JobSpec, lane: Lane) -> str:
    """The spec's owner for a lane, else that lane's on-call."""
    return getattr(spec.owners, lane.value) or f"{lane.value} on-call"


def lost_work(facts: AttemptFacts, resume_step: int, spec: JobSpec) -> LostWork | None:
    """Steps past the resume step, times the attempt's GPUs, times its step time (None without heartbeats)."""
    if facts.last_step is None:
        return None
    steps = max(facts.last_step - resume_step, 0)
    gpus = facts.gpus or spec.workers * spec.gpus_per_worker
    step_time = facts.step_time_s
    hours = None if step_time is None else round(steps * gpus * step_time / _SECONDS_PER_HOUR, 6)
    return LostWork(steps=steps, gpus=gpus, step_time_s=step_time, gpu_hours=hours)


def crash_loop(knowledge: JobKnowledge, facts: AttemptFacts, first: FirstError, count: int) -> str | None:
    """Why automatic recovery must stop, when this failure repeats an earlier one `count` times in all."""
    resumed_from = facts.resumed_from or 0
    earlier = [d for d in knowledge.decisions if not d.manual and d.superseded_by is None and d.attempt < facts.number]
    on_node = 1 + sum(1 for d in earlier if first.node and d.first_error == first.label and d.node == first.node)
    if first.node and on_node >= count:
        return f"crash loop: {first.label} on {first.node} {on_node} times (limit {count})"
    from_checkpoint = 1 + sum(1 for d in earlier if d.first_error == first.label and d.resumed_from == resumed_from)
    if from_checkpoint >= count:
        start = f"checkpoint step {resumed_from}" if resumed_from else "the start"
        return f"crash loop: {first.label} from {start} {from_checkpoint} times (limit {count})"
    return None


@dataclass(frozen=True)
class _Assessment:
    """What a failure decision rests on, gathered once: the rule, the guards and the start point."""

    spec: JobSpec
    first: FirstError
    rule: Rule
    limits: Effective
    why: str
    owner_lane: Lane
    stop: str | None
    """Why automatic recovery is off, or None."""
    checkpoint: SavedCheckpoint | None
    resume_step: int | None
    notes: tuple[str, ...]

    @property
    def found(self) -> str:
        where = f" on {self.first.node}" if self.first.node else ""
        return f"{self.first.label}{where}" + (f" ({self.first.summary})" if self.first.summary else "")


def assess(
    knowledge: JobKnowledge,
    facts: AttemptFacts,
    policy: Policy,
    verified: Verified,
    recently_cordoned: AbstractSet[str] = frozenset(),
) -> _Assessment:
    """Apply the policy rule, then the guards that make a failure non-recoverable whatever the rule says.

    `recently_cordoned`: the nodes recovery cordoned within the policy's cordon budget window.
    """
    spec = _spec(knowledge)
    first = assumed_first_error(facts)
    position, rule = policy.rule_for(spec.workload_class, first.lane, first.category)
    limits = policy.limits(rule)
    why = rule.why or f"rule {position} of {spec.workload_class}"
    budget = min(spec.retry_budget, limits.max_retries)
    owner_lane = rule.owner_lane or first.lane
    stop: str | None = None
    if rule.action is RecoveryAction.MANUAL:
        stop = f"{first.label} is not recovered automatically ({why})"
    elif facts.number - 1 >= budget:
        stop = f"retry budget spent: {facts.number - 1} of {budget} retries used"
    else:
        stop = crash_loop(knowledge, facts, first, limits.crash_loop_count)
    node = cordoned_node(first, rule)
    if stop is None and node is not None:
        stop = over_budget(node, recently_cordoned, policy.defaults.cordon_budget)
    refused_cordon = _no_node_evidence(first, rule)
    checkpoint = None
    resume_step: int | None = None
    notes: tuple[str, ...] = ()
    if spec.workload_class is WorkloadClass.TRAINING:
        if verified.usable:
            checkpoint = verified.usable[0]
            resume_step = checkpoint.step
        elif verified.had_checkpoints:
            if stop is None:
                # A version mismatch is not fixed by running again, and it is the platform's to sort out.
                fields = ", ".join(sorted({r.field for r in verified.refused}))
                stop = f"every recorded checkpoint was refused ({fields}): no verified state to resume from"
                owner_lane = rule.owner_lane or Lane.PLATFORM
        else:
            resume_step = 0
            notes = ("the job never recorded a checkpoint: it resumes from the start",)
    elif spec.workload_class in {WorkloadClass.EVALUATION, WorkloadClass.BATCH}:
        resume_step = 0
    notes = (refused_cordon, *notes) if refused_cordon else notes
    return _Assessment(spec, first, rule, limits, why, owner_lane, stop, checkpoint, resume_step, notes)


def decide_failure(
    knowledge: JobKnowledge,
    facts: AttemptFacts,
    policy: Policy,
    verified: Verified,
    *,
    now: datetime,
    decision_id: str,
    recently_cordoned: AbstractSet[str] = frozenset(),
) -> Plan:
    """Decide how a failed attempt recovers (or that it waits for its owner).

    `recently_cordoned`: the nodes recovery cordoned within the cordon budget's window (every job's decisions
    in force), which the budget counts this decision's cordon against.
    """
    a = assess(knowledge, facts, policy, verified, recently_cordoned)
    owner = owner_of(a.spec, a.owner_lane)
    base: dict[str, Any] = {
        "finding_id": facts.finding.id if facts.finding else (facts.ended_by or decision_id),
        "finding_version": facts.finding.version if facts.finding else None,
        "settled": facts.finding is not None and facts.finding.settled,
        "first_error": a.first.label,
        "culprit": Culprit(lane=a.first.lane, category=a.first.category, node=a.first.node, rank=a.first.rank),
        "policy": policy.name,
        "policy_version": policy.version,
        "workload_class": a.spec.workload_class.value,
        "owner": owner,
        "owner_lane": a.owner_lane,
        "checkpoint": a.checkpoint.ref() if a.checkpoint else None,
        "refused": verified.refused if spec_is_training(a.spec) else (),
        "retries_used": facts.number - 1,
        "resume_step": a.resume_step,
        "lost_work": lost_work(facts, a.resume_step or 0, a.spec)
        if a.spec.workload_class is WorkloadClass.TRAINING
        else None,
    }
    if a.stop is not None:
        deadline = now + timedelta(seconds=a.limits.manual_deadline_s)
        reason = (
            f"{_unsettled(facts)}{a.found}: {a.stop}; waiting for {owner} until {deadline.isoformat()}"
            + _refused_text(verified)
        )
        decision = RecoveryDecidedData(
            **base,
            action=RecoveryAction.MANUAL,
            reason=reason,
            rollback=f"nothing to undo: no action was taken; decide with `lanes recover {knowledge.job_id} "
            "--approve | --rollback | --abandon --reason ...`",
            expects=MANUAL_ACTION,
            deadline=deadline,
        )
        hold = ManualWait(
            decision_id=decision_id,
            attempt=facts.number,
            owner=owner,
            owner_lane=a.owner_lane,
            deadline=deadline,
            reason=f"{a.found}: {a.stop}",
            finding_id=decision.finding_id,
        )
        return Plan(decision=decision, hold=hold, replica_out=_replica_out(a.spec, a.found), notes=a.notes)
    return _automatic(knowledge, facts, policy, verified, a, base=base, now=now, decision_id=decision_id, owner=owner)


def _automatic(
    knowledge: JobKnowledge,
    facts: AttemptFacts,
    policy: Policy,
    verified: Verified,
    a: _Assessment,
    *,
    base: dict[str, Any],
    now: datetime,
    decision_id: str,
    owner: str,
) -> Plan:
    cordons = _cordons(knowledge.job_id, facts, a.first, a.rule, owner)
    backoff = a.limits.backoff.delay_s(facts.number - 1)
    action = a.rule.action
    following = facts.number + 1
    steps = {
        RecoveryAction.RESUME: f"resume attempt {following} from "
        + (f"verified checkpoint step {a.resume_step}" if a.checkpoint else "the start"),
        RecoveryAction.REBUILD: f"rebuild from the start as attempt {following}",
        RecoveryAction.REPLACE_REPLICA: f"take replica {knowledge.job_id} out of rotation and place a replacement "
        f"of the same version as attempt {following}",
    }[action]
    cordon = f"cordon {', '.join(c.node for c in cordons)}, " if cordons else ""
    wait = f" after {backoff:g} s backoff" if backoff else ""
    serving = a.spec.serving
    guard = (
        f"; meanwhile the router protects requests ({serving.protection.value}, Retry-After {serving.retry_after_s} s)"
        if serving
        else ""
    )
    reason = (
        f"{_unsettled(facts)}{a.found}: {cordon}{steps} once attempt {facts.number}'s resources are released"
        f"{wait} ({a.why}){guard}" + "".join(f"; {n}" for n in a.notes) + _refused_text(verified)
    )
    undo = [f"`lanes topology state {c.node} ready` returns {c.node} to scheduling" for c in cordons]
    undo.append(f"`lanes cancel {knowledge.job_id}` stops attempt {following}")
    decision = RecoveryDecidedData(
        **base,
        action=action,
        reason=reason,
        rollback="; ".join(undo),
        expects=ATTEMPT_REQUESTED,
        cordon=tuple(c.node for c in cordons),
        backoff_s=backoff,
        protection=serving.protection if serving else None,
    )
    retry = PendingRetry(
        decision_id=decision_id,
        attempt=facts.number,
        command="retry",
        resume_step=a.resume_step,
        reason=f"{action.value} after {a.first.label} (policy {policy.name} v{policy.version})",
        requested_by=RECOVERY,
        due_at=now + timedelta(seconds=backoff),
        avoid_nodes=tuple(c.node for c in cordons),
    )
    out = _replica_out(a.spec, a.found) if action is RecoveryAction.REPLACE_REPLICA else None
    return Plan(decision=decision, cordons=cordons, replica_out=out, retry=retry, notes=a.notes)


def decide_manual(
    knowledge: JobKnowledge,
    action: ManualAction,
    *,
    requested_by: str,
    why: str,
    policy: Policy,
    verified: Verified,
    now: datetime,
    decision_id: str,
) -> Plan | Refusal:
    """Carry out an owner's decision for a job waiting on the manual path."""
    wait = knowledge.manual
    if wait is None:
        return Refusal(f"no manual recovery decision is pending for job {knowledge.job_id}")
    spec = _spec(knowledge)
    who = requested_by or "an unnamed owner"
    facts = knowledge.attempt(wait.attempt)
    base: dict[str, Any] = {
        "finding_id": wait.finding_id,
        "finding_version": facts.finding.version if facts.finding else None,
        "first_error": assumed_first_error(facts).label,
        "policy": policy.name,
        "policy_version": policy.version,
        "workload_class": spec.workload_class.value,
        "owner": wait.owner,
        "owner_lane": wait.owner_lane,
        "refused": verified.refused if spec_is_training(spec) else (),
        "retries_used": facts.number - 1,
        "manual_action": action,
        "requested_by": requested_by,
    }
    said = f": {why}" if why else ""
    if action is ManualAction.ABANDON:
        decision = RecoveryDecidedData(
            **base,
            action=RecoveryAction.ABANDON,
            reason=f"abandoned by {who}{said}",
            rollback=f"`lanes retry {knowledge.job_id}` starts a new attempt of the cancelled job",
            expects=STATE_CHANGED,
        )
        return Plan(decision=decision, abandon=True)
    checkpoint, resume_step, how = _manual_start(spec, verified, rollback=action is ManualAction.ROLLBACK)
    recovery = {
        WorkloadClass.TRAINING: RecoveryAction.RESUME,
        WorkloadClass.INFERENCE: RecoveryAction.REPLACE_REPLICA,
    }.get(spec.workload_class, RecoveryAction.REBUILD)
    decision = RecoveryDecidedData(
        **base,
        action=recovery,
        reason=f"{action.value} by {who}{said}: attempt {facts.number + 1} {how} once attempt {facts.number}'s "
        "resources are released",
        rollback=f"`lanes cancel {knowledge.job_id}` stops attempt {facts.number + 1}",
        expects=ATTEMPT_REQUESTED,
        checkpoint=checkpoint.ref() if checkpoint else None,
        resume_step=resume_step,
        lost_work=lost_work(facts, resume_step, spec) if resume_step is not None else None,
    )
    retry = PendingRetry(
        decision_id=decision_id,
        attempt=facts.number,
        command="resume",
        resume_step=resume_step,
        reason=f"{action.value} by {who}{said}",
        requested_by=requested_by or RECOVERY,
        due_at=now,
    )
    return Plan(decision=decision, retry=retry)


def _manual_start(
    spec: JobSpec, verified: Verified, *, rollback: bool
) -> tuple[SavedCheckpoint | None, int | None, str]:
    if spec.workload_class is WorkloadClass.INFERENCE:
        return None, None, "replaces the replica (same model version)"
    if spec.workload_class is not WorkloadClass.TRAINING:
        return None, 0, "rebuilds from the start"
    index = 1 if rollback else 0
    if len(verified.usable) > index:
        checkpoint = verified.usable[index]
        kind = "the verified checkpoint before the last" if rollback else "the last verified checkpoint"
        return checkpoint, checkpoint.step, f"resumes from {kind}, step {checkpoint.step}"
    missing = "no earlier verified checkpoint" if rollback else "no verified checkpoint"
    return None, 0, f"starts from the beginning ({missing})"


def _spec(knowledge: JobKnowledge) -> JobSpec:
    if knowledge.spec is None:
        msg = f"job {knowledge.job_id}: recovery has not seen its submission"
        raise ValueError(msg)
    return knowledge.spec


def cordoned_node(first: FirstError, rule: Rule) -> str | None:
    """The node the rule cordons for this first error: only on host or network evidence about that node."""
    if not rule.cordon or not first.node or not is_valid_token(first.node):
        return None
    if first.lane not in {Lane.HOST, Lane.NETWORK} or first.category in NO_NODE_EVIDENCE:
        return None
    return first.node


def over_budget(node: str, recently_cordoned: AbstractSet[str], budget: CordonBudget) -> str | None:
    """Why cordoning `node` needs a person: it would exceed the cordon budget (None: within it).

    A node already cordoned within the window costs nothing more; any other counts one.
    """
    if node in recently_cordoned or len(recently_cordoned) < budget.max_nodes:
        return None
    return (
        f"cordon budget spent: recovery cordoned {len(recently_cordoned)} node(s) within the last "
        f"{budget.window_s:g} s ({', '.join(sorted(recently_cordoned)) or 'none'}; at most {budget.max_nodes} "
        f"without a person's approval), so {node} is not cordoned automatically"
    )


def _no_node_evidence(first: FirstError, rule: Rule) -> str | None:
    """What the decision says when its rule would cordon, but the first error is no evidence about the node."""
    if not rule.cordon or not first.node or first.lane not in {Lane.HOST, Lane.NETWORK}:
        return None
    if first.category not in NO_NODE_EVIDENCE:
        return None
    return f"{first.node} is not cordoned: {first.label} is no host or network evidence about it"


def _cordons(job_id: str, facts: AttemptFacts, first: FirstError, rule: Rule, owner: str) -> tuple[Cordon, ...]:
    node = cordoned_node(first, rule)
    if node is None:
        return ()
    reason = f"recovery of {job_id} attempt {facts.number}: {first.summary or first.label}; owner {owner}"
    return (Cordon(node=node, lane=first.lane, reason=reason),)


def _replica_out(spec: JobSpec, found: str) -> ReplicaOut | None:
    if spec.serving is None:
        return None
    return ReplicaOut(model=spec.serving.model, version=spec.serving.version, reason=f"recovery: {found}")


def _unsettled(facts: AttemptFacts) -> str:
    """The decision's admission that it did not wait for a settled finding (its grace ran out)."""
    if not facts.placed or (facts.finding is not None and facts.finding.settled):
        return ""
    if facts.finding is None:
        return "decided without a finding (the grace ran out): "
    return f"decided without a settled finding (the grace ran out at finding v{facts.finding.version}): "


def _refused_text(verified: Verified) -> str:
    if not verified.refused:
        return ""
    parts = [f"step {r.checkpoint.step} ({r.field}: expected {r.expected}, found {r.found})" for r in verified.refused]
    return "; refused " + ", ".join(parts)
