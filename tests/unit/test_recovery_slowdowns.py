"""Recovery's answer to a slow training attempt: restart it elsewhere only when that costs less than running on."""

from __future__ import annotations

from typing import Literal

import pytest
from support.recovery_events import POLICY, SPEC, at, changed, checkpoint, heartbeat, keys, placed, submitted

from lanes_contract.events import Event, JobSlowdown, JobSlowdownData, Lane, RecoveryAction
from lanes_contract.jobs import JobSpec, JobState, ServingSpec, WorkloadClass
from lanes_recovery.domain.checkpoints import Verified, verify_checkpoints
from lanes_recovery.domain.decisions import Plan
from lanes_recovery.domain.knowledge import JobKnowledge, PendingRetry, fold
from lanes_recovery.domain.policy import Policy
from lanes_recovery.domain.slowdowns import decide_slowdown

LONG_RUN = SPEC.model_copy(update={"steps": 10_000})

Kind = Literal["compute_straggler", "degraded_link", "imbalance"]


def slowdown(kind: Kind = "compute_straggler", node: str | None = "node-2", slower: float = 0.5) -> JobSlowdown:
    data = JobSlowdownData(
        kind=kind,
        rank=1 if node else None,
        node=node,
        onset_step=60,
        slowdown=slower,
        lost_s=40.0,
        gpu_hours=0.1,
        summary=f"rank 1 on {node}: step time +{slower:.0%} since step 60",
    )
    return JobSlowdown(data=data, lane=Lane.HOST, **keys(1, 215, rank=1, node=node or "node-1"))


def knowledge(spec: JobSpec, *events: Event) -> JobKnowledge:
    known: JobKnowledge | None = None
    for event in (submitted(spec), placed(), *events):
        known = fold(known, event)
    assert known is not None
    return known


def decide(known: JobKnowledge, policy: Policy = POLICY, cordoned: frozenset[str] = frozenset()) -> Plan:
    assert known.spec is not None
    verified: Verified = verify_checkpoints(known.checkpoints, known.spec, known.attempts, {})
    return decide_slowdown(
        known, known.attempt(1), policy, verified, now=at(220), decision_id="d-slow", recently_cordoned=cordoned
    )


# Steps 10 to 110 in 200 s: 2 s a step on average, 1.33 s before a 50% slowdown; a checkpoint at step 100.
RUNNING = (heartbeat(10, 10), checkpoint(100, seconds=190), heartbeat(110, 210))


def test_a_slow_node_with_many_steps_left_is_restarted_from_the_checkpoint_away_from_it() -> None:
    plan = decide(knowledge(LONG_RUN, *RUNNING, slowdown()))
    decision = plan.decision
    assert decision.action is RecoveryAction.RESTART
    # 0.5 x 1.33 s x 9,890 steps left = 6,593 s against 300 s + 10 steps redone x 1.33 s = 313 s.
    assert "would cost 6593 s over the 9890 steps left, a restart 313 s" in decision.reason
    assert decision.resume_step == 100
    assert decision.cordon == ("node-2",)
    assert [c.node for c in plan.cordons] == ["node-2"]
    assert plan.stop is not None
    assert plan.retry is not None
    assert (plan.retry.resume_step, plan.retry.avoid_nodes, plan.retry.attempt) == (100, ("node-2",), 1)
    assert decision.culprit is not None
    assert (decision.culprit.node, decision.culprit.rank, decision.first_error) == (
        "node-2",
        1,
        "host/compute_straggler",
    )


def test_near_the_end_the_attempt_runs_on_and_the_decision_says_both_figures() -> None:
    plan = decide(knowledge(SPEC.model_copy(update={"steps": 120}), *RUNNING, slowdown()))
    assert plan.decision.action is RecoveryAction.NONE
    assert "runs on; the slowness would cost 7 s over the 10 steps left, a restart 313 s" in plan.decision.reason
    assert (plan.stop, plan.retry, plan.cordons) == (None, None, ())


@pytest.mark.parametrize(
    ("spec", "event", "why"),
    [
        (SPEC, slowdown(), "the spec sets no `steps`"),
        (LONG_RUN, slowdown("imbalance", node=None), "no node to move away from (imbalance is the job's own)"),
        (
            LONG_RUN.model_copy(
                update={
                    "workload_class": WorkloadClass.INFERENCE,
                    "serving": ServingSpec(model="m", version="v1"),
                }
            ),
            slowdown(),
            "only training restarts for a slowdown",
        ),
        (LONG_RUN.model_copy(update={"retry_budget": 0}), slowdown(), "retry budget spent: 0 of 0 retries used"),
    ],
    ids=["no-steps", "imbalance", "inference", "no-retries-left"],
)
def test_what_cannot_be_weighed_or_moved_runs_on_and_says_why(spec: JobSpec, event: JobSlowdown, why: str) -> None:
    plan = decide(knowledge(spec, *RUNNING, event))
    assert plan.decision.action is RecoveryAction.NONE
    assert why in plan.decision.reason
    assert plan.stop is None


def test_a_policy_that_never_restarts_for_slowdowns_lets_it_run() -> None:
    defaults = POLICY.defaults.model_copy(
        update={"slowdowns": POLICY.defaults.slowdowns.model_copy(update={"restart": False})}
    )
    plan = decide(knowledge(LONG_RUN, *RUNNING, slowdown()), POLICY.model_copy(update={"defaults": defaults}))
    assert plan.decision.action is RecoveryAction.NONE
    assert "does not restart for a slowdown" in plan.decision.reason


def test_with_the_cordon_budget_spent_it_restarts_away_from_the_node_without_cordoning_it() -> None:
    spent = frozenset({"node-7", "node-8", "node-9"})
    plan = decide(knowledge(LONG_RUN, *RUNNING, slowdown()), cordoned=spent)
    assert plan.decision.action is RecoveryAction.RESTART
    assert plan.cordons == ()
    assert plan.retry is not None
    assert plan.retry.avoid_nodes == ("node-2",)
    assert "cordon budget spent" in plan.decision.reason


def test_only_the_first_slowdown_of_an_attempt_is_kept() -> None:
    later = slowdown(node="node-1", slower=0.9)
    known = knowledge(LONG_RUN, *RUNNING, slowdown(), later)
    seen = known.attempt(1).slowdown
    assert seen is not None
    assert seen.node == "node-2"
    assert [f.number for f in known.slowdowns_to_decide()] == [1]


def test_the_cancel_that_stops_a_restarted_attempt_keeps_the_retry_owed_and_any_other_cancel_voids_it() -> None:
    known = knowledge(LONG_RUN, *RUNNING, slowdown())
    owed = PendingRetry(
        decision_id="d-slow",
        attempt=1,
        command="retry",
        resume_step=100,
        reason="restart",
        requested_by="lanes/recovery",
        due_at=at(220),
        restart=True,
    )
    restarting = fold(known.model_copy(update={"pending": owed}), changed(JobState.CANCELLED, seconds=230))
    assert restarting.pending == owed
    cancelled = fold(
        known.model_copy(update={"pending": owed.model_copy(update={"restart": False})}),
        changed(JobState.CANCELLED, seconds=230),
    )
    assert cancelled.pending is None
