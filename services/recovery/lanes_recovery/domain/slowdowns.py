"""What recovery does about a training attempt that runs slow: run on, or restart it elsewhere. Pure.

Nothing failed, so no rule of the policy applies; the question is only whether a restart pays. It does when the
time the slowness would still cost, `slowdown x baseline step time x steps left`, is more than the restart's:
the policy's `restart_cost_s` (stopping, placing again, loading) plus the steps redone since the last verified
checkpoint. Then recovery stops the attempt, cordons the slow node (within the cordon budget) and resumes a new
attempt from that checkpoint away from it. Either way the decision gives both figures, so the owner sees why
the job restarted, or why it did not.

The baseline step time is the attempt's mean step time divided by (1 + slowdown): the mean includes the steps
before the onset, so this is low, the projected loss too, and recovery errs towards letting a job run.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from lanes_contract.events import Culprit, RecoveryAction, RecoveryDecidedData
from lanes_contract.jobs import JobSpec
from lanes_recovery.domain.checkpoints import Verified
from lanes_recovery.domain.decisions import (
    ATTEMPT_REQUESTED,
    RECOVERY,
    STATE_CHANGED,
    Cordon,
    Plan,
    lost_work,
    over_budget,
    owner_of,
    spec_is_training,
)
from lanes_recovery.domain.knowledge import AttemptFacts, JobKnowledge, PendingRetry, SlowdownSeen
from lanes_recovery.domain.policy import Policy


@dataclass(frozen=True)
class Weighed:
    """A restart weighed against running on: the seconds each costs, and from which checkpoint it would resume."""

    loss_s: float
    """What the slowness costs over the steps left, if the attempt runs on."""
    cost_s: float
    """What a restart costs: the policy's fixed cost plus the steps redone since the checkpoint."""
    resume_step: int | None
    steps_left: int

    @property
    def pays(self) -> bool:
        """Whether a restart costs less than the slowness would."""
        return self.loss_s > self.cost_s


def weigh(spec: JobSpec, facts: AttemptFacts, slow: SlowdownSeen, policy: Policy, verified: Verified) -> Weighed | str:
    """The restart weighed, or why it cannot be (what is unknown)."""
    if spec.steps is None:
        return "the spec sets no `steps`, so the steps left (and what the slowness costs) are unknown"
    step_time, last = facts.step_time_s, facts.last_step
    if step_time is None or last is None:
        return "the attempt has not reported enough steps to know its step time"
    baseline = step_time / (1 + slow.slowdown)
    steps_left = max(spec.steps - last, 0)
    resume_step = verified.usable[0].step if verified.usable else None
    redone = last - (resume_step or 0)
    cost = policy.defaults.slowdowns.restart_cost_s + max(redone, 0) * baseline
    return Weighed(
        loss_s=slow.slowdown * baseline * steps_left, cost_s=cost, resume_step=resume_step, steps_left=steps_left
    )


def decide_slowdown(
    knowledge: JobKnowledge,
    facts: AttemptFacts,
    policy: Policy,
    verified: Verified,
    *,
    now: datetime,
    decision_id: str,
    recently_cordoned: AbstractSet[str] = frozenset(),
) -> Plan:
    """Run on, or restart the running attempt from its last verified checkpoint away from the slow node."""
    spec, slow = knowledge.spec, facts.slowdown
    if spec is None or slow is None:
        msg = "a slowdown decision needs the job's spec and the attempt's slowdown"
        raise ValueError(msg)
    owner = owner_of(spec, slow.lane)
    base: dict[str, Any] = {
        "finding_id": slow.id,
        "first_error": f"{slow.lane.value}/{slow.kind}",
        "culprit": Culprit(lane=slow.lane, category=slow.kind, node=slow.node, rank=slow.rank),
        "policy": policy.name,
        "policy_version": policy.version,
        "workload_class": spec.workload_class.value,
        "owner": owner,
        "owner_lane": slow.lane,
        "retries_used": facts.number - 1,
    }
    found = slow.summary or f"{slow.lane.value}/{slow.kind}"
    weighed = _restartable(knowledge, facts, slow, policy, verified)
    if isinstance(weighed, str):
        return _run_on(base, found, weighed)
    figures = (
        f"the slowness would cost {weighed.loss_s:.0f} s over the {weighed.steps_left} steps left, "
        f"a restart {weighed.cost_s:.0f} s"
    )
    if not weighed.pays:
        return _run_on(base, found, figures)
    node = slow.node
    assert node is not None  # noqa: S101 - _restartable returns a reason when no node is named
    following = facts.number + 1
    start = f"verified checkpoint step {weighed.resume_step}" if weighed.resume_step is not None else "the start"
    spent = over_budget(node, recently_cordoned, policy.defaults.cordon_budget)
    cordons = () if spent else (Cordon(node=node, lane=slow.lane, reason=f"{found} (job {knowledge.job_id})"),)
    cordon = f"cordon {node}, " if cordons else ""
    reason = (
        f"{found}: {figures}; {cordon}stop attempt {facts.number} and resume attempt {following} from {start} "
        f"away from {node}" + (f" ({spent})" if spent else "")
    )
    undo = [f"`lanes topology state {node} ready` returns {node} to scheduling"] if cordons else []
    undo.append(f"`lanes cancel {knowledge.job_id}` stops attempt {following}")
    decision = RecoveryDecidedData(
        **base,
        action=RecoveryAction.RESTART,
        reason=reason,
        rollback="; ".join(undo),
        expects=ATTEMPT_REQUESTED,
        cordon=tuple(c.node for c in cordons),
        checkpoint=verified.usable[0].ref() if verified.usable else None,
        resume_step=weighed.resume_step,
        lost_work=lost_work(facts, weighed.resume_step or 0, spec),
    )
    retry = PendingRetry(
        decision_id=decision_id,
        attempt=facts.number,
        command="retry",
        resume_step=weighed.resume_step,
        reason=f"restart after {slow.lane.value}/{slow.kind} on {node} (policy {policy.name} v{policy.version})",
        requested_by=RECOVERY,
        due_at=now,
        avoid_nodes=(node,),
        restart=True,
    )
    return Plan(decision=decision, cordons=cordons, retry=retry, stop=reason)


def _restartable(
    knowledge: JobKnowledge, facts: AttemptFacts, slow: SlowdownSeen, policy: Policy, verified: Verified
) -> Weighed | str:
    """The restart weighed, or why the attempt runs on without weighing it."""
    spec = knowledge.spec
    assert spec is not None  # noqa: S101 - checked by the caller
    if not spec_is_training(spec):
        return "only training restarts for a slowdown (from a checkpoint)"
    if not policy.defaults.slowdowns.restart:
        return f"policy {policy.name} does not restart for a slowdown"
    if slow.node is None:
        return f"no node to move away from ({slow.kind} is the job's own)"
    budget = min(spec.retry_budget, policy.defaults.max_retries)
    if facts.number - 1 >= budget:
        return f"retry budget spent: {facts.number - 1} of {budget} retries used"
    return weigh(spec, facts, slow, policy, verified)


def _run_on(base: dict[str, Any], found: str, why: str) -> Plan:
    decision = RecoveryDecidedData(
        **base,
        action=RecoveryAction.NONE,
        reason=f"{found}: the attempt runs on; {why}",
        rollback="nothing to undo: no action was taken",
        expects=STATE_CHANGED,
    )
    return Plan(decision=decision)
