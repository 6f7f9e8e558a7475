"""No cordon on a guess, and never more than the budget: recovery's pure core.

A node is cordoned only on host or network evidence about it; an exit nobody explains waits for its owner
and cordons nothing; and however many failures a rule sees, at most `cordon_budget.max_nodes` nodes are
cordoned within `cordon_budget.window_s` before a person has to approve the next one.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from support.recovery_events import POLICY, SPEC, at, changed, finding, placed, submitted

from lanes_contract.events import Event, Lane, RecoveryAction
from lanes_contract.jobs import JobSpec, JobState, ServingSpec, WorkloadClass
from lanes_recovery.domain.checkpoints import Verified
from lanes_recovery.domain.decisions import Plan, decide_failure, over_budget
from lanes_recovery.domain.knowledge import JobKnowledge, fold
from lanes_recovery.domain.policy import CordonBudget, Policy

NOTHING_TO_VERIFY = Verified((), ())


def _knowledge(*events: Event) -> JobKnowledge:
    known: JobKnowledge | None = None
    for event in events:
        known = fold(known, event)
    assert known is not None
    return known


def _decide(
    lane: Lane,
    category: str,
    *,
    spec: JobSpec = SPEC,
    recently: frozenset[str] = frozenset(),
    policy: Policy = POLICY,
) -> Plan:
    known = _knowledge(submitted(spec), placed(), finding(lane, category, node="node-2"), changed(JobState.FAILED))
    return decide_failure(
        known, known.attempt(1), policy, NOTHING_TO_VERIFY, now=at(40), decision_id="d-1", recently_cordoned=recently
    )


def test_an_unexplained_exit_cordons_nothing_and_waits_for_the_jobs_owner():
    plan = _decide(Lane.PLATFORM, "unexplained_exit")
    assert plan.cordons == ()
    assert plan.decision.action is RecoveryAction.MANUAL
    assert (plan.decision.owner, plan.decision.owner_lane) == ("ada", Lane.ALGORITHM)
    assert "no evidence says why" in plan.decision.reason


def test_an_exit_status_or_a_signal_alone_in_the_host_lane_resumes_without_a_cordon_and_says_why():
    plan = _decide(Lane.HOST, "process_exited")
    assert plan.decision.action is RecoveryAction.RESUME
    assert plan.cordons == ()
    assert plan.decision.cordon == ()
    assert "node-2 is not cordoned: host/process_exited is no host or network evidence about it" in (
        plan.decision.reason
    )


def test_host_evidence_still_cordons_its_node():
    plan = _decide(Lane.HOST, "oom_kill")
    assert plan.decision.cordon == ("node-2",)
    assert "not cordoned" not in plan.decision.reason


def test_beyond_the_budget_the_decision_asks_a_person_instead_of_cordoning():
    recently = frozenset({"node-5", "node-6", "node-7"})  # the shipped budget: 3 nodes per hour
    plan = _decide(Lane.HOST, "gpu_xid", recently=recently)
    assert plan.cordons == ()
    assert plan.decision.action is RecoveryAction.MANUAL
    assert plan.hold is not None
    assert plan.decision.owner == "hal"  # the host lane's owner in the spec
    assert "cordon budget spent: recovery cordoned 3 node(s) within the last 3600 s" in plan.decision.reason
    assert "node-2 is not cordoned automatically" in plan.decision.reason
    # A node already cordoned within the window costs nothing more.
    again = _decide(Lane.HOST, "gpu_xid", recently=recently | {"node-2"})
    assert again.decision.cordon == ("node-2",)


def test_an_inference_replica_beyond_the_budget_still_leaves_rotation_while_it_waits():
    serving = ServingSpec(model="tiny-chat", version="v3")
    spec = JobSpec(name="serve", workload_class=WorkloadClass.INFERENCE, workers=1, serving=serving, owners=SPEC.owners)
    plan = _decide(Lane.HOST, "gpu_xid", spec=spec, recently=frozenset({"a", "b", "c"}))
    assert plan.decision.action is RecoveryAction.MANUAL
    assert plan.replica_out is not None
    assert plan.cordons == ()


@given(
    max_nodes=st.integers(min_value=0, max_value=6),
    failures=st.lists(st.sampled_from([f"node-{n}" for n in range(1, 13)]), max_size=30),
)
def test_no_sequence_of_failures_cordons_more_nodes_than_the_budget(max_nodes: int, failures: list[str]) -> None:
    budget = CordonBudget(max_nodes=max_nodes, window_s=3600)
    cordoned: set[str] = set()
    for node in failures:
        if over_budget(node, cordoned, budget) is None:
            cordoned.add(node)
    assert len(cordoned) <= max_nodes
    # Every node asked for while the budget had room was cordoned: the budget refuses only the excess.
    assert len(cordoned) == min(max_nodes, len(set(failures)))


def test_the_budget_is_a_policy_setting():
    tight = POLICY.model_copy(
        update={"defaults": POLICY.defaults.model_copy(update={"cordon_budget": CordonBudget(max_nodes=0)})}
    )
    plan = _decide(Lane.HOST, "oom_kill", policy=tight)
    assert plan.decision.action is RecoveryAction.MANUAL
    assert "at most 0 without a person's approval" in plan.decision.reason
    assert POLICY.defaults.cordon_budget == CordonBudget(max_nodes=3, window_s=3600)
