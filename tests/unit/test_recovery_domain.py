"""Recovery's pure core: policy validation, the knowledge fold, the checkpoint gate, decisions, lost work."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support.recovery_events import (
    CONFIG,
    DATA,
    MODEL,
    POLICY,
    SPEC,
    at,
    changed,
    checkpoint,
    finding,
    heartbeat,
    keys,
    placed,
    released,
    submitted,
)

from lanes_contract.events import (
    AttemptRequested,
    AttemptRequestedData,
    CheckpointSaved,
    CheckpointSavedData,
    Event,
    Lane,
    ManualAction,
    RecoveryAction,
)
from lanes_contract.jobs import JobSpec, JobState, ProtectionMode, ServingSpec, WorkloadClass
from lanes_recovery.domain.checkpoints import DigestVerdict, Verified, verify_checkpoints
from lanes_recovery.domain.decisions import Plan, Refusal, decide_failure, decide_manual, lost_work
from lanes_recovery.domain.knowledge import JobKnowledge, fold
from lanes_recovery.domain.policy import Backoff, PolicyError, parse_policy


def knowledge(*events: Event) -> JobKnowledge:
    known: JobKnowledge | None = None
    for event in events:
        known = fold(known, event)
    assert known is not None
    return known


def gate(known: JobKnowledge, digests: dict[tuple[str, str], DigestVerdict] | None = None) -> Verified:
    assert known.spec is not None
    return verify_checkpoints(known.checkpoints, known.spec, known.attempts, digests or {})


def decide(known: JobKnowledge, attempt: int = 1, digests: dict[tuple[str, str], DigestVerdict] | None = None) -> Plan:
    return decide_failure(
        known, known.attempt(attempt), POLICY, gate(known, digests), now=at(40), decision_id=f"d-{attempt}"
    )


TRAINING_RUN = (submitted(), placed(), heartbeat(100, 2), heartbeat(300, 12, rank=1), checkpoint(100), checkpoint(200))


# --- policy --------------------------------------------------------------------------------------


def test_the_shipped_policy_validates_and_has_rules_for_every_class():
    assert POLICY.name == "lanes-default"
    assert set(POLICY.classes) == set(WorkloadClass)
    assert POLICY.rule_for(WorkloadClass.TRAINING, Lane.HOST, "oom_kill")[1].cordon
    assert (
        POLICY.rule_for(WorkloadClass.TRAINING, Lane.ALGORITHM, "python_exception")[1].action is RecoveryAction.MANUAL
    )
    assert POLICY.rule_for(WorkloadClass.TRAINING, Lane.NETWORK, "collective_hang")[1].cordon is False
    assert POLICY.rule_for(WorkloadClass.INFERENCE, Lane.HOST, "gpu_xid")[1].action is RecoveryAction.REPLACE_REPLICA


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("classes:\n  training: {rules: [{action: resume}]}", "no rules for"),
        (
            "classes:\n"
            + "".join(f"  {c}: {{rules: [{{action: manual}}]}}\n" for c in ("inference", "evaluation", "batch"))
            + "  training: {rules: [{action: rebuild}]}",
            "action rebuild is not one of",
        ),
        (
            "classes:\n"
            + "".join(f"  {c}: {{rules: [{{action: manual}}]}}\n" for c in ("inference", "evaluation", "batch"))
            + "  training: {rules: [{match: {lane: host}, action: resume}]}",
            "last rule must match every lane",
        ),
        ("classes: [", "not valid YAML"),
    ],
)
def test_an_invalid_policy_is_refused_with_the_reason(change: str, message: str):
    with pytest.raises(PolicyError, match=message):
        parse_policy(f"name: p\nversion: 1\n{change}\n")


def test_backoff_grows_and_is_capped():
    backoff = Backoff(base_s=2, factor=3, max_s=10)
    assert [backoff.delay_s(n) for n in range(4)] == [2, 6, 10, 10]


# --- checkpoint gate -----------------------------------------------------------------------------


def test_the_gate_refuses_a_version_mismatch_naming_the_field_and_keeps_the_previous_checkpoint():
    known = knowledge(*TRAINING_RUN, checkpoint(300, data_version="sha256:" + "99" * 32))
    verified = gate(known)
    assert [c.step for c in verified.usable] == [200, 100]
    assert [(r.checkpoint.step, r.field, r.expected) for r in verified.refused] == [(300, "data_version", DATA)]


def test_the_gate_refuses_a_corrupted_checkpoint_by_its_digest():
    known = knowledge(*TRAINING_RUN)
    digests = {("/ckpt/200", "sha256:" + f"{200:064x}"): DigestVerdict(checked=True, matches=False, found="sha256:00")}
    verified = gate(known, digests)
    assert [c.step for c in verified.usable] == [100]
    assert verified.refused[0].field == "digest"
    assert verified.refused[0].found == "sha256:00"


def test_the_gate_refuses_a_checkpoint_that_records_no_version_the_spec_sets_unless_the_policy_accepts_it():
    known = knowledge(*TRAINING_RUN[:4], checkpoint(100, image=None))
    assert known.spec is not None
    refused = verify_checkpoints(known.checkpoints, known.spec, known.attempts, {})
    assert [(r.field, r.found) for r in refused.refused] == [("image", None)]
    accepted = verify_checkpoints(known.checkpoints, known.spec, known.attempts, {}, unrecorded_versions="accept")
    assert [c.step for c in accepted.usable] == [100]


def test_the_gate_refuses_a_step_before_the_one_its_attempt_started_from():
    requested = AttemptRequested(data=AttemptRequestedData(reason="r", resume_step=200), **keys(2, 35))
    known = knowledge(*TRAINING_RUN, requested, checkpoint(150, attempt=2, seconds=36))
    refused = gate(known).refused
    assert [(r.checkpoint.step, r.field) for r in refused] == [(150, "step")]


def test_all_shards_of_a_step_must_pass():
    bad_shard = CheckpointSaved(
        data=CheckpointSavedData(
            step=200, path="/ckpt/200-rank1", digest="sha256:" + "ee" * 32, model_version=MODEL, data_version=DATA,
            config_version=CONFIG, image="other:2",
        ),
        **keys(1, 6, rank=1, node="node-2"),
    )  # fmt: skip
    verified = gate(knowledge(*TRAINING_RUN, bad_shard))
    assert [c.step for c in verified.usable] == [100]
    assert [(r.checkpoint.path, r.field) for r in verified.refused] == [("/ckpt/200-rank1", "image")]


# --- the fold ------------------------------------------------------------------------------------


def test_an_attempt_is_decided_once_it_failed_and_its_finding_names_a_first_error_in_either_order():
    before = knowledge(*TRAINING_RUN, finding(Lane.HOST, "oom_kill"), changed(JobState.FAILED))
    after = knowledge(*TRAINING_RUN, changed(JobState.FAILED), finding(Lane.HOST, "oom_kill"))
    for known in (before, after):
        assert [(f.number, late) for f, late in known.awaiting_decision(at(31), timedelta(seconds=60))] == [(1, False)]


def test_a_failure_without_a_finding_waits_for_the_grace_period_and_user_cancels_and_successes_never_wait():
    known = knowledge(*TRAINING_RUN, changed(JobState.FAILED, seconds=30))
    grace = timedelta(seconds=60)
    assert known.awaiting_decision(at(89), grace) == []
    assert known.next_due_at(grace) == at(90)
    assert [late for _, late in known.awaiting_decision(at(90), grace)] == [True]
    for ended in (JobState.CANCELLED, JobState.SUCCEEDED):
        quiet = knowledge(*TRAINING_RUN, changed(ended))
        assert quiet.awaiting_decision(at(1000), grace) == []
        assert quiet.next_due_at(grace) is None


def test_a_failure_long_before_recovery_saw_it_is_stale():
    known = knowledge(*TRAINING_RUN, changed(JobState.FAILED, seconds=30))
    day = timedelta(days=1)
    assert known.stale_failures(at(30) + day, day) == []
    assert [f.number for f in known.stale_failures(at(31) + day, day)] == [1]


def test_a_later_finding_version_after_the_decision_is_recorded_not_decided_again():
    known = knowledge(*TRAINING_RUN, finding(Lane.HOST, "process_exited"), changed(JobState.FAILED))
    facts = known.attempt(1)
    known = known.with_attempt(facts.model_copy(update={"decided": True}))
    known = fold(known, finding(Lane.HOST, "oom_kill", version=2))
    kept = known.attempt(1).finding
    assert kept is not None
    assert kept.version == 1
    assert known.attempt(1).findings_after_decision == (2,)
    assert known.awaiting_decision(at(1000), timedelta(0)) == []


def test_lost_work_is_steps_past_the_resume_step_times_gpus_times_step_time():
    known = knowledge(*TRAINING_RUN)
    work = lost_work(known.attempt(1), 200, SPEC)
    assert work is not None
    assert (work.steps, work.gpus) == (100, 8)
    assert work.step_time_s == pytest.approx(10 / 200)
    assert work.gpu_hours == pytest.approx(100 * 8 * 0.05 / 3600, abs=1e-6)


# --- decisions -----------------------------------------------------------------------------------


def test_a_host_error_cordons_the_node_and_resumes_from_the_last_verified_checkpoint():
    known = knowledge(*TRAINING_RUN, finding(Lane.HOST, "oom_kill"), changed(JobState.FAILED))
    plan = decide(known)
    d = plan.decision
    assert d.action is RecoveryAction.RESUME
    assert [c.node for c in plan.cordons] == ["node-2"] == list(d.cordon)
    assert plan.cordons[0].lane is Lane.HOST
    assert "owner hal" in plan.cordons[0].reason
    assert d.checkpoint is not None
    assert d.checkpoint.step == 200 == d.resume_step
    assert d.lost_work is not None
    assert d.lost_work.steps == 100
    assert (d.first_error, d.owner, d.owner_lane) == ("host/oom_kill", "hal", Lane.HOST)
    assert d.expects == "io.lanes.job.attempt_requested.v1"
    assert "lanes topology state node-2 ready" in d.rollback
    assert (d.policy, d.policy_version) == ("lanes-default", 1)
    assert plan.retry is not None
    assert plan.retry.resume_step == 200
    assert plan.retry.avoid_nodes == ("node-2",)  # the new attempt is kept off the cordoned node by its request
    assert plan.retry.due_at == at(40 + 2)  # the first retry waits the policy's base backoff


def test_a_retry_that_cordons_nothing_avoids_no_node():
    known = knowledge(*TRAINING_RUN, finding(Lane.PLATFORM, "preemption"), changed(JobState.FAILED))
    plan = decide(known)
    assert plan.cordons == ()
    assert plan.retry is not None
    assert plan.retry.avoid_nodes == ()  # only cordoned nodes are avoided; a preempted node stays usable


def test_an_algorithm_error_goes_to_its_owner_with_a_deadline_and_no_retry():
    known = knowledge(*TRAINING_RUN, finding(Lane.ALGORITHM, "python_exception"), changed(JobState.FAILED))
    plan = decide(known)
    assert plan.decision.action is RecoveryAction.MANUAL
    assert (plan.decision.owner, plan.decision.owner_lane) == ("ada", Lane.ALGORITHM)
    assert plan.decision.deadline == at(40 + 3600)
    assert plan.hold is not None
    assert plan.hold.owner == "ada"
    assert plan.retry is None
    assert plan.cordons == ()
    assert plan.decision.expects == "io.lanes.job.manual_action.v1"


def test_every_checkpoint_refused_is_a_version_mismatch_for_the_platform_owner():
    other = "sha256:" + "77" * 32
    known = knowledge(
        submitted(), placed(), heartbeat(300, 10), checkpoint(100, model_version=other),
        checkpoint(200, model_version=other), finding(Lane.HOST, "gpu_xid"), changed(JobState.FAILED),
    )  # fmt: skip
    plan = decide(known)
    assert plan.decision.action is RecoveryAction.MANUAL
    assert plan.decision.owner == "pat"
    assert {r.field for r in plan.decision.refused} == {"model_version"}
    assert "every recorded checkpoint was refused" in plan.decision.reason
    assert plan.cordons == ()


def test_a_job_that_never_checkpointed_resumes_from_the_start_and_says_so():
    known = knowledge(submitted(), placed(), heartbeat(50, 3), finding(Lane.HOST, "oom_kill"), changed(JobState.FAILED))
    plan = decide(known)
    assert plan.decision.action is RecoveryAction.RESUME
    assert plan.decision.resume_step == 0
    assert "never recorded a checkpoint" in plan.decision.reason


def test_a_spent_retry_budget_stops_automatic_recovery():
    spec = SPEC.model_copy(update={"retry_budget": 1})
    known = knowledge(
        submitted(spec), placed(), finding(Lane.HOST, "oom_kill"), changed(JobState.FAILED), released(),
        placed(2, ("node-3", "node-4")), finding(Lane.HOST, "gpu_xid", node="node-3", attempt=2),
        changed(JobState.FAILED, attempt=2, seconds=60),
    )  # fmt: skip
    plan = decide(known, attempt=2)
    assert plan.decision.action is RecoveryAction.MANUAL
    assert "retry budget spent: 1 of 1" in plan.decision.reason


def test_the_same_first_error_from_the_same_checkpoint_n_times_is_a_crash_loop():
    policy = parse_policy(
        "name: p\nversion: 2\ndefaults: {crash_loop_count: 2}\nclasses:\n"
        + "".join(f"  {c}: {{rules: [{{action: manual}}]}}\n" for c in ("inference", "evaluation", "batch"))
        + "  training: {rules: [{action: resume}]}\n"
    )
    events: list[Event] = [submitted(), placed(), checkpoint(100)]
    known = knowledge(*events, finding(Lane.PLATFORM, "preemption", node="node-1"), changed(JobState.FAILED))
    first = decide_failure(known, known.attempt(1), policy, gate(known), now=at(40), decision_id="d-1")
    assert first.decision.action is RecoveryAction.RESUME
    known = known.model_copy(
        update={"decisions": (*known.decisions, _record("d-1", 1, "platform/preemption", "node-1", 0))}
    )
    requested = AttemptRequested(data=AttemptRequestedData(reason="r", resume_step=100), **keys(2, 45))
    known = fold(fold(known, requested), placed(2, ("node-3",), seconds=46))
    known = fold(known, finding(Lane.PLATFORM, "preemption", node="node-3", attempt=2))
    known = fold(known, changed(JobState.FAILED, attempt=2, seconds=60))
    second = decide_failure(known, known.attempt(2), policy, gate(known), now=at(61), decision_id="d-2")
    assert second.decision.action is RecoveryAction.RESUME  # from 0 first, from 100 now: not the same start
    known = known.model_copy(
        update={"decisions": (*known.decisions, _record("d-2", 2, "platform/preemption", "node-3", 100))}
    )
    requested = AttemptRequested(data=AttemptRequestedData(reason="r", resume_step=100), **keys(3, 65))
    known = fold(fold(known, requested), placed(3, ("node-4",), seconds=66))
    known = fold(known, finding(Lane.PLATFORM, "preemption", node="node-4", attempt=3))
    known = fold(known, changed(JobState.FAILED, attempt=3, seconds=80))
    third = decide_failure(known, known.attempt(3), policy, gate(known), now=at(81), decision_id="d-3")
    assert third.decision.action is RecoveryAction.MANUAL
    assert "crash loop: platform/preemption from checkpoint step 100 2 times (limit 2)" in third.decision.reason


def _record(decision_id: str, attempt: int, first_error: str, node: str, resumed_from: int):
    from lanes_recovery.domain.knowledge import DecisionRecord  # noqa: PLC0415 - only these tests build records

    return DecisionRecord(
        id=decision_id, attempt=attempt, action=RecoveryAction.RESUME, first_error=first_error, node=node,
        resumed_from=resumed_from, resume_step=100, finding_id="f", decided_at=at(40),
    )  # fmt: skip


def test_the_same_first_error_on_the_same_node_n_times_is_a_crash_loop():
    known = knowledge(*TRAINING_RUN, finding(Lane.HOST, "gpu_xid", node="node-2"), changed(JobState.FAILED))
    earlier = [_record(f"d-{n}", n, "host/gpu_xid", "node-2", n * 10) for n in (1, 2)]
    known = known.model_copy(update={"decisions": tuple(earlier)})
    facts = known.attempt(1).model_copy(update={"number": 3})
    plan = decide_failure(known, facts, POLICY, gate(known), now=at(40), decision_id="d-3")
    assert plan.decision.action is RecoveryAction.MANUAL
    assert "crash loop: host/gpu_xid on node-2 3 times (limit 3)" in plan.decision.reason


def test_inference_takes_the_replica_out_and_replaces_it_with_the_same_version_under_its_protection_mode():
    serving = ServingSpec(model="tiny-chat", version="v3", protection=ProtectionMode.QUEUE)
    spec = JobSpec(name="serve", workload_class=WorkloadClass.INFERENCE, workers=1, serving=serving)
    known = knowledge(submitted(spec), placed(), finding(Lane.HOST, "gpu_xid"), changed(JobState.FAILED))
    plan = decide(known)
    assert plan.decision.action is RecoveryAction.REPLACE_REPLICA
    assert plan.decision.protection is ProtectionMode.QUEUE
    assert plan.replica_out is not None
    assert (plan.replica_out.model, plan.replica_out.version) == ("tiny-chat", "v3")
    assert plan.retry is not None
    assert plan.retry.resume_step is None
    assert plan.retry.due_at == at(40)  # inference replaces at once
    assert plan.decision.lost_work is None


@pytest.mark.parametrize("workload", [WorkloadClass.EVALUATION, WorkloadClass.BATCH])
def test_evaluation_and_batch_are_rebuilt_from_the_start_without_checkpoint_logic(workload: WorkloadClass):
    spec = JobSpec(name="eval", workload_class=workload, workers=2)
    known = knowledge(submitted(spec), placed(), checkpoint(100), finding(Lane.PLATFORM, "preemption"))
    known = fold(known, changed(JobState.FAILED))
    plan = decide(known)
    assert plan.decision.action is RecoveryAction.REBUILD
    assert plan.decision.resume_step == 0
    assert plan.decision.checkpoint is None
    assert plan.decision.refused == ()
    assert plan.cordons == ()


def test_no_finding_after_the_grace_period_is_platform_unknown_and_manual():
    known = knowledge(*TRAINING_RUN, changed(JobState.FAILED))
    plan = decide(known)
    assert plan.decision.first_error == "platform/unknown"
    assert plan.decision.action is RecoveryAction.MANUAL
    assert plan.decision.owner == "pat"


# --- manual actions ------------------------------------------------------------------------------


def _held() -> JobKnowledge:
    known = knowledge(*TRAINING_RUN, finding(Lane.ALGORITHM, "python_exception"), changed(JobState.FAILED))
    plan = decide(known)
    return known.model_copy(update={"manual": plan.hold})


def _manual(known: JobKnowledge, action: ManualAction) -> Plan | Refusal:
    return decide_manual(
        known, action, requested_by="ada", why="fixed the loader", policy=POLICY, verified=gate(known),
        now=at(100), decision_id="m-1",
    )  # fmt: skip


def test_approve_resumes_from_the_last_verified_checkpoint_and_rollback_from_the_one_before():
    approve = _manual(_held(), ManualAction.APPROVE)
    assert isinstance(approve, Plan)
    assert approve.decision.action is RecoveryAction.RESUME
    assert (approve.decision.manual_action, approve.decision.requested_by) == (ManualAction.APPROVE, "ada")
    assert approve.retry is not None
    assert (approve.retry.command, approve.retry.resume_step) == ("resume", 200)
    rollback = _manual(_held(), ManualAction.ROLLBACK)
    assert isinstance(rollback, Plan)
    assert rollback.retry is not None
    assert rollback.retry.resume_step == 100
    assert "before the last" in rollback.decision.reason


def test_abandon_ends_the_job_and_an_action_with_nothing_pending_is_refused():
    abandon = _manual(_held(), ManualAction.ABANDON)
    assert isinstance(abandon, Plan)
    assert abandon.abandon
    assert abandon.decision.action is RecoveryAction.ABANDON
    assert abandon.retry is None
    refused = _manual(knowledge(*TRAINING_RUN), ManualAction.APPROVE)
    assert isinstance(refused, Refusal)
