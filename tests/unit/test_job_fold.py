"""Unit tests for the lifecycle's job state machine, ``evolve(view, event)``: a pure fold over events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from lanes_contract.errors import PoisonEventError
from lanes_contract.events import (
    ArtifactProduced,
    ArtifactProducedData,
    CancelRequested,
    CheckpointSaved,
    CheckpointSavedData,
    CheckpointStarted,
    CheckpointStartedData,
    CommandData,
    CommunicatorReady,
    CommunicatorReadyData,
    Event,
    FindingCause,
    Heartbeat,
    HeartbeatData,
    HoldRequested,
    HoldRequestedData,
    JobFinding,
    JobFindingData,
    JobPlaced,
    JobPlacedData,
    JobRejected,
    JobRejectedData,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    JobWaiting,
    JobWaitingData,
    Lane,
    NodeRegistered,
    NodeRegisteredData,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    RendezvousDone,
    RendezvousDoneData,
    ResourcesReleased,
    ResourcesReleasedData,
    ResumeRequested,
    RetryData,
    RetryRequested,
)
from lanes_contract.jobs import FailureCause, JobSpec, JobState, Owners, SuccessCriteria
from lanes_lifecycle.domain.job import IllegalTransitionError, JobFlag, JobView, Transition, evolve

T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)
JOB = "job-1"
SPEC = JobSpec(name="train-llm", workers=2, gpus_per_worker=4)
ASSIGNMENTS = (
    RankAssignment(rank=0, node="node-1", gpus=(0, 1, 2, 3)),
    RankAssignment(rank=1, node="node-2", gpus=(0, 1, 2, 3)),
)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _keys(rank: int | None, seconds: float, keys: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"jobid": JOB, "attempt": 1, "time": _at(seconds)}
    if rank is not None:
        fields |= {"node": f"node-{rank + 1}", "rank": rank}
    return fields | keys


def submitted(spec: JobSpec = SPEC, **keys: Any) -> JobSubmitted:
    return JobSubmitted(source="lanes/api", data=JobSubmittedData(spec=spec), **_keys(None, 0, keys))


def waiting(reason: str = "capacity_short", seconds: float = 1, **keys: Any) -> JobWaiting:
    return JobWaiting(source="lanes/scheduler", data=JobWaitingData(reason=reason), **_keys(None, seconds, keys))


def placed(seconds: float = 2, **keys: Any) -> JobPlaced:
    data = JobPlacedData(assignments=ASSIGNMENTS)
    return JobPlaced(source="lanes/scheduler", data=data, **_keys(None, seconds, keys))


def started(rank: int, seconds: float = 3, **keys: Any) -> RankStarted:
    return RankStarted(source="agent", data=RankStartedData(pid=1000 + rank), **_keys(rank, seconds, keys))


def rendezvous(rank: int, seconds: float = 4, **keys: Any) -> RendezvousDone:
    return RendezvousDone(source="agent", data=RendezvousDoneData(world_size=2), **_keys(rank, seconds, keys))


def ready(rank: int, seconds: float = 5, **keys: Any) -> CommunicatorReady:
    return CommunicatorReady(source="agent", data=CommunicatorReadyData(backend="nccl"), **_keys(rank, seconds, keys))


def heartbeat(step: int, seconds: float = 6, rank: int = 0, **keys: Any) -> Heartbeat:
    return Heartbeat(source="agent", data=HeartbeatData(step=step), **_keys(rank, seconds, keys))


def ckpt_started(step: int, seconds: float = 6, **keys: Any) -> CheckpointStarted:
    return CheckpointStarted(source="agent", data=CheckpointStartedData(step=step), **_keys(0, seconds, keys))


def ckpt_saved(step: int, seconds: float = 7, **keys: Any) -> CheckpointSaved:
    data = CheckpointSavedData(step=step, path=f"s3://ckpt/{step}", digest="sha256:" + "ab" * 32)
    return CheckpointSaved(source="agent", data=data, **_keys(0, seconds, keys))


def artifact(name: str, seconds: float = 8, **keys: Any) -> ArtifactProduced:
    data = ArtifactProducedData(artifact=name, path=f"s3://out/{name}")
    return ArtifactProduced(source="agent", data=data, **_keys(0, seconds, keys))


def exited(rank: int, exit_code: int | None = 0, signal: int | None = None, seconds: float = 10, **keys: Any):
    data = RankExitedData(exit_code=exit_code, signal=signal)
    return RankExited(source="agent", data=data, **_keys(rank, seconds, keys))


def released(seconds: float = 20, **keys: Any) -> ResourcesReleased:
    data = ResourcesReleasedData(nodes=("node-1", "node-2"), gpus=8)
    return ResourcesReleased(source="lanes/scheduler", data=data, **_keys(None, seconds, keys))


def rejected(seconds: float = 1, **keys: Any) -> JobRejected:
    data = JobRejectedData(reason="spec_mismatch", detail="no B200 in the cluster")
    return JobRejected(source="lanes/scheduler", data=data, **_keys(None, seconds, keys))


def cancel(seconds: float = 9, **keys: Any) -> CancelRequested:
    data = CommandData(reason="wrong config", requested_by="alice")
    return CancelRequested(source="lanes/cli", data=data, **_keys(None, seconds, keys))


def retry(seconds: float = 30, **keys: Any) -> RetryRequested:
    return RetryRequested(source="lanes/cli", data=RetryData(reason="try again"), **_keys(None, seconds, keys))


def hold(seconds: float = 30, **keys: Any) -> HoldRequested:
    data = HoldRequestedData(reason="needs a look", deadline=_at(3600))
    return HoldRequested(source="lanes/cli", data=data, **_keys(None, seconds, keys))


def resume(seconds: float = 40, **keys: Any) -> ResumeRequested:
    return ResumeRequested(source="lanes/cli", data=RetryData(), **_keys(None, seconds, keys))


def finding(version: int, lane: Lane = Lane.NETWORK, seconds: float = 15, **keys: Any) -> JobFinding:
    first = FindingCause(category="link_flap", lane=lane, node="node-2", summary="ibp94s0 flapped on node-2")
    data = JobFindingData(version=version, first_error=first, stage="steady_state", confidence=0.9)
    return JobFinding(source="lanes/telemetry", data=data, **_keys(None, seconds, keys))


def fold(*events: Event) -> tuple[JobView, list[Transition | None]]:
    view: JobView | None = None
    transitions: list[Transition | None] = []
    for event in events:
        view, transition = evolve(view, event)
        transitions.append(transition)
    assert view is not None
    return view, transitions


def states(transitions: list[Transition | None]) -> list[JobState]:
    return [t.to_state for t in transitions if t is not None]


def _moved(transition: Transition | None, from_state: JobState | None, to_state: JobState) -> Transition:
    assert transition is not None
    assert (transition.from_state, transition.to_state) == (from_state, to_state)
    return transition


START = (submitted(), placed(), started(0), rendezvous(0), started(1), rendezvous(1), ready(0), ready(1))
"""A job that got to running: both ranks started, met and initialised their communicator."""


# --- the happy path ------------------------------------------------------------------------------


def test_the_full_path_from_submitted_to_released_with_every_state_and_cause():
    view, transitions = fold(*START, heartbeat(100), exited(1, seconds=10), exited(0, seconds=11), released())
    assert states(transitions) == [
        JobState.QUEUED,
        JobState.ADMITTED,
        JobState.STARTING,
        JobState.RUNNING,
        JobState.SUCCEEDED,
        JobState.RELEASED,
    ]
    assert [t.sequence for t in transitions if t] == [1, 2, 3, 4, 5, 6]
    _moved(transitions[0], JobState.SUBMITTED, JobState.QUEUED)
    succeeded = next(t for t in transitions if t and t.to_state is JobState.SUCCEEDED)
    assert succeeded.cause is FailureCause.NORMAL_COMPLETION
    assert view.state is JobState.RELEASED
    attempt = view.current
    assert attempt.state is JobState.RELEASED
    assert attempt.cause is FailureCause.NORMAL_COMPLETION
    assert attempt.started_at == _at(3)
    assert attempt.ended_at == _at(11)
    assert attempt.released
    assert attempt.lost_steps == 0  # a completed attempt loses nothing, checkpoint or not
    assert {r.rank: r.state for r in attempt.ranks.values()} == {0: "succeeded", 1: "succeeded"}
    assert JobFlag.RESOURCES_RELEASED in view.flags
    assert [s.cause_type for s in view.history][:2] == ["io.lanes.job.submitted.v1", "io.lanes.job.placed.v1"]


def test_time_in_each_state_comes_from_event_times():
    view, _ = fold(
        submitted(),
        waiting(seconds=1),
        placed(seconds=2),
        started(0, seconds=5),
        started(1, seconds=5),
        ready(0, seconds=6),
    )
    view, _ = evolve(view, ready(1, seconds=8))
    spent = view.time_in_states(_at(20))
    assert spent == {"queued": 2.0, "admitted": 3.0, "starting": 3.0, "running": 12.0}


def test_a_repeated_wait_updates_the_reason_without_a_transition():
    view, transitions = fold(submitted(), waiting("capacity_short"), waiting("spec_mismatch"))
    assert view.wait_reason == "spec_mismatch"
    assert states(transitions) == [JobState.QUEUED]


def test_starting_waits_for_every_rank_communicator():
    view, transitions = fold(submitted(), placed(), started(0), started(1), ready(0))
    assert view.state is JobState.STARTING
    assert states(transitions)[-1] is JobState.STARTING
    view, transition = evolve(view, ready(1))
    assert _moved(transition, JobState.STARTING, JobState.RUNNING).reason == "every rank's communicator is ready"


def test_ranks_that_finish_without_reporting_ready_still_succeed():
    _view, transitions = fold(submitted(), placed(), started(0), started(1), exited(0), exited(1))
    assert states(transitions) == [JobState.QUEUED, JobState.ADMITTED, JobState.STARTING, JobState.SUCCEEDED]


def test_repeated_rank_events_are_no_ops():
    view, _ = fold(*START, exited(0))
    again, transition = evolve(view, exited(0, exit_code=1))
    assert transition is None
    assert again == view
    for event in (started(1), rendezvous(1), ready(1), ready(0)):
        assert evolve(view, event) == (view, None)


# --- checkpoints, artifacts, lost work -------------------------------------------------------------


def test_checkpointing_is_a_flag_on_running_and_the_saved_checkpoint_is_verified():
    view, _ = fold(*START, heartbeat(90), ckpt_started(100))
    assert view.state is JobState.RUNNING
    assert view.flags == (JobFlag.CHECKPOINTING,)
    view, transition = evolve(view, ckpt_saved(100))
    assert transition is None
    assert view.flags == ()
    assert view.current.last_checkpoint is not None
    assert view.current.last_checkpoint.step == 100
    view, _ = evolve(view, ckpt_saved(50))  # an older save never replaces a newer one
    assert view.current.last_checkpoint is not None
    assert view.current.last_checkpoint.step == 100
    view, _ = evolve(view, heartbeat(130))
    assert view.current.lost_steps == 30


def test_required_artifacts_decide_success():
    spec = SPEC.model_copy(update={"success": SuccessCriteria(required_artifacts=("model",))})
    base = (submitted(spec), *START[1:])
    missing, _ = fold(*base, exited(0), exited(1))
    assert missing.state is JobState.FAILED
    assert missing.current.cause is FailureCause.USER_CODE_ERROR
    assert "model" in (missing.current.cause_detail or "")
    done, _transitions = fold(*base, artifact("model"), exited(0), exited(1))
    assert done.state is JobState.SUCCEEDED
    assert done.current.artifacts == {"model": "s3://out/model"}


# --- failures ------------------------------------------------------------------------------------


def test_one_failing_rank_makes_the_job_partially_failed_then_failed_when_all_ended():
    view, transitions = fold(*START, exited(1, exit_code=3, seconds=9))
    failed = _moved(transitions[-1], JobState.RUNNING, JobState.PARTIALLY_FAILED)
    assert "rank 1" in failed.reason
    assert view.current.cause is FailureCause.USER_CODE_ERROR
    view, transition = evolve(view, exited(0, exit_code=0, seconds=12))
    ended = _moved(transition, JobState.PARTIALLY_FAILED, JobState.FAILED)
    assert ended.cause is FailureCause.USER_CODE_ERROR
    assert ended.reason == "rank 1 on node-2 exited with code 3"
    assert view.current.ended_at == _at(12)
    assert view.current.failed_ranks == {1}
    assert view.current.succeeded_ranks == {0}


@pytest.mark.parametrize(
    ("signal", "cause"),
    [(9, FailureCause.NODE_FAULT), (15, FailureCause.PLATFORM_ACTION), (11, FailureCause.USER_CODE_ERROR)],
)
def test_a_signal_maps_to_a_cause(signal, cause):
    view, _transitions = fold(*START, exited(0, exit_code=None, signal=signal), exited(1, exit_code=None, signal=15))
    assert view.state is JobState.FAILED
    assert view.current.cause is cause  # the first failure names the cause, not the consequences
    assert f"signal {signal}" in (view.current.cause_detail or "")


def test_a_rejection_by_the_scheduler_fails_the_job_as_a_platform_action():
    _view, transitions = fold(submitted(), rejected())
    ended = _moved(transitions[-1], JobState.QUEUED, JobState.FAILED)
    assert ended.cause is FailureCause.PLATFORM_ACTION
    assert "spec_mismatch" in ended.reason
    assert "B200" in ended.reason


def test_later_exits_of_a_failed_attempt_are_recorded_without_a_transition():
    view, _ = fold(submitted(), placed(), started(0), exited(0, exit_code=2, seconds=9))
    assert view.state is JobState.FAILED  # rank 1 never started: nothing else to wait for
    after, transition = evolve(view, started(1, seconds=10))
    after, transition = evolve(after, exited(1, exit_code=143, seconds=12))
    assert transition is None
    assert after.state is JobState.FAILED
    assert after.current.failed_ranks == {0, 1}
    assert after.current.ended_at == _at(9)


# --- cancel --------------------------------------------------------------------------------------


def test_cancel_while_queued_cancels_at_once():
    _view, transitions = fold(submitted(), cancel())
    ended = _moved(transitions[-1], JobState.QUEUED, JobState.CANCELLED)
    assert ended.cause is FailureCause.USER_CANCEL
    assert "alice" in ended.reason


def test_cancel_while_starting_stops_the_ranks_first():
    view, transitions = fold(submitted(), placed(), started(0), cancel())
    _moved(transitions[-1], JobState.STARTING, JobState.CANCELLING)
    assert evolve(view, cancel(seconds=10)) == (view, None)  # asked twice: the first request stands
    view, transition = evolve(view, exited(0, exit_code=None, signal=15))
    ended = _moved(transition, JobState.CANCELLING, JobState.CANCELLED)
    assert ended.cause is FailureCause.USER_CANCEL
    assert view.current.cause is FailureCause.USER_CANCEL


def test_cancel_after_the_end_is_illegal():
    view, _ = fold(*START, exited(0), exited(1))
    with pytest.raises(IllegalTransitionError, match="not allowed"):
        evolve(view, cancel())


# --- attempts ------------------------------------------------------------------------------------


def _failed() -> JobView:
    return fold(*START, heartbeat(150), ckpt_saved(100), exited(1, exit_code=1), exited(0))[0]


def test_retry_creates_a_numbered_attempt_that_resumes_from_the_last_verified_checkpoint():
    view, transition = evolve(_failed(), retry())
    moved = _moved(transition, JobState.FAILED, JobState.RETRYING)
    assert moved.new_attempt == 2
    assert moved.resume_step == 100
    assert view.job_id == JOB
    assert [a.number for a in view.attempts] == [1, 2]
    assert view.attempts[0].state is JobState.FAILED
    assert view.attempts[0].lost_steps == 50
    transitions: list[Transition | None] = []
    for event in (waiting(attempt=2, seconds=31), placed(attempt=2, seconds=32), started(0, attempt=2, seconds=33)):
        view, step = evolve(view, event)
        transitions.append(step)
    assert states(transitions) == [JobState.QUEUED, JobState.ADMITTED, JobState.STARTING]
    assert view.current.number == 2
    assert view.current.resume_step == 100


def test_a_retry_carries_the_nodes_to_avoid_on_to_the_new_attempt():
    avoid = retry().model_copy(update={"data": RetryData(reason="node-1 cordoned", avoid_nodes=("node-1",))})
    _, transition = evolve(_failed(), avoid)
    assert _moved(transition, JobState.FAILED, JobState.RETRYING).avoid_nodes == ("node-1",)


def test_a_retry_that_names_no_nodes_avoids_none():
    _, transition = evolve(_failed(), retry())
    assert _moved(transition, JobState.FAILED, JobState.RETRYING).avoid_nodes == ()


def test_events_of_an_old_attempt_are_recorded_against_it_and_never_move_the_job():
    view, _ = fold(*START, exited(1, exit_code=1))  # partially failed: rank 0 still runs
    view, _ = evolve(view, cancel(seconds=11))
    view, _ = evolve(view, exited(0, exit_code=None, signal=15, seconds=12))
    view, _ = evolve(view, retry(seconds=13))
    view, _ = evolve(view, placed(attempt=2, seconds=14))
    before = view.current
    view, transition = evolve(view, released(attempt=1, seconds=15))
    assert transition is None
    assert view.state is JobState.ADMITTED
    assert view.current == before
    assert view.attempts[0].released
    view, transition = evolve(view, heartbeat(999, attempt=1))
    assert transition is None
    assert view.attempts[0].last_step == 999
    assert view.current.last_step is None


def test_a_stale_retry_is_rejected():
    view, _ = evolve(_failed(), retry())
    with pytest.raises(IllegalTransitionError, match="attempt 1, but the job is on attempt 2"):
        evolve(view, retry(seconds=31, attempt=1))


def test_the_retry_budget_is_enforced():
    spec = SPEC.model_copy(update={"retry_budget": 1})
    view, _ = fold(submitted(spec), rejected())
    view, _ = evolve(view, retry())
    view, _ = evolve(view, rejected(attempt=2, seconds=31))
    with pytest.raises(IllegalTransitionError, match="retry budget"):
        evolve(view, retry(seconds=32, attempt=2))


def test_a_succeeded_job_is_not_retried():
    view, _ = fold(*START, exited(0), exited(1), released())
    with pytest.raises(IllegalTransitionError, match="succeeded"):
        evolve(view, retry())


def test_hold_puts_a_failed_job_on_the_manual_path_with_the_lane_owner():
    spec = SPEC.model_copy(update={"owners": Owners(algorithm="ml-oncall")})
    view, _ = fold(submitted(spec), *START[1:], exited(0, exit_code=1), exited(1))
    view, transition = evolve(view, hold())
    _moved(transition, JobState.FAILED, JobState.AWAITING_MANUAL)
    assert view.manual is not None
    assert view.manual.owner == "ml-oncall"  # the cause is user code: the algorithm lane's owner
    assert view.manual.deadline == _at(3600)
    view, transition = evolve(view, released(seconds=31))
    assert transition is None  # the allocation is freed while the owner decides
    assert JobFlag.RESOURCES_RELEASED in view.flags
    view, transition = evolve(view, resume())
    assert _moved(transition, JobState.AWAITING_MANUAL, JobState.RETRYING).new_attempt == 2
    assert view.manual is None


def test_a_resume_pinned_to_a_verified_checkpoint_starts_the_next_attempt_there():
    view, _ = fold(*START, ckpt_saved(100), ckpt_saved(200, seconds=8), exited(0, exit_code=1), exited(1), hold())
    view, transition = evolve(view, resume().model_copy(update={"data": RetryData(resume_step=100)}))
    assert transition is not None
    assert transition.resume_step == 100  # the recovery's verified step, not the latest saved one (200)
    assert view.current.resume_step == 100


def test_abandoning_a_held_job_cancels_it_and_keeps_the_failure_cause():
    view, _ = fold(*START, exited(0, exit_code=1), exited(1), hold())
    failed_cause = view.current.cause
    view, transition = evolve(view, cancel(seconds=35))
    _moved(transition, JobState.AWAITING_MANUAL, JobState.CANCELLED)
    assert view.manual is None
    assert view.current.cause is failed_cause is FailureCause.USER_CODE_ERROR
    assert "abandoned by alice: wrong config" in view.history[-1].reason


# --- illegal events ------------------------------------------------------------------------------


def _queued() -> JobView:
    return fold(submitted())[0]


def _running() -> JobView:
    return fold(*START)[0]


def _succeeded() -> JobView:
    return fold(*START, exited(0), exited(1))[0]


def _released() -> JobView:
    return fold(*START, exited(0), exited(1), released())[0]


@pytest.mark.parametrize("event", [placed(), waiting(), started(0), exited(0), released()], ids=lambda e: e.name)
def test_an_event_for_an_unknown_job_is_illegal(event):
    with pytest.raises(IllegalTransitionError, match="never submitted"):
        evolve(None, event)


def test_a_submission_as_a_later_attempt_is_illegal():
    with pytest.raises(IllegalTransitionError, match="submitted as attempt 1"):
        evolve(None, submitted(attempt=2))


@pytest.mark.parametrize("view", [_queued, _running, _succeeded, _released], ids=lambda f: f.__name__.strip("_"))
def test_a_second_submit_is_illegal(view):
    with pytest.raises(IllegalTransitionError, match="already submitted"):
        evolve(view(), submitted())


@pytest.mark.parametrize(
    ("view", "event"),
    [(_queued, placed(attempt=2)), (_running, started(1, attempt=2)), (_succeeded, released(attempt=3))],
    ids=["placed", "rank_started", "resources_released"],
)
def test_an_event_for_a_future_attempt_is_illegal(view, event):
    with pytest.raises(IllegalTransitionError, match="has only reached attempt 1"):
        evolve(view(), event)


def test_an_event_without_an_attempt_applies_to_the_current_one():
    view, transition = evolve(_queued(), placed(attempt=None))
    _moved(transition, JobState.QUEUED, JobState.ADMITTED)
    assert view.current.number == 1


@pytest.mark.parametrize(
    ("view", "event"),
    [
        pytest.param(_running, placed(), id="placement-for-a-running-job"),
        pytest.param(_succeeded, placed(), id="placement-for-a-finished-job"),
        pytest.param(lambda: fold(submitted(), placed())[0], placed(), id="second-placement"),
        pytest.param(_running, waiting(), id="waiting-for-a-running-job"),
        pytest.param(_running, rejected(), id="rejection-of-a-running-job"),
        pytest.param(_running, released(), id="release-of-a-running-job"),
        pytest.param(_queued, released(), id="release-of-a-queued-job"),
        pytest.param(_released, released(), id="second-release"),
        pytest.param(_running, retry(), id="retry-of-a-running-job"),
        pytest.param(_running, resume(), id="resume-of-a-job-not-held"),
        pytest.param(_running, hold(), id="hold-of-a-running-job"),
    ],
)
def test_an_event_the_state_does_not_allow_is_illegal(view, event):
    before = view()
    with pytest.raises(IllegalTransitionError, match=f"not allowed for job {JOB} in state {before.state}"):
        evolve(before, event)


@pytest.mark.parametrize("event", [started(0), exited(0)], ids=lambda e: e.name)
def test_a_rank_event_before_placement_is_illegal(event):
    with pytest.raises(IllegalTransitionError, match="not placed"):
        evolve(_queued(), event)


def test_a_rank_the_placement_does_not_hold_is_illegal():
    with pytest.raises(IllegalTransitionError, match="rank 7"):
        evolve(_running(), started(7))


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(
            RankStarted(source="agent/node-1", jobid=JOB, attempt=1, data=RankStartedData(pid=1)), id="rank_started"
        ),
        pytest.param(
            RankExited(source="agent/node-1", jobid=JOB, attempt=1, data=RankExitedData(exit_code=0)),
            id="rank_exited",
        ),
    ],
)
def test_a_rank_event_without_a_rank_is_illegal(event):
    with pytest.raises(IllegalTransitionError, match="has no rank"):
        evolve(_running(), event)


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(
            JobStateChanged(
                source="lanes/lifecycle",
                jobid=JOB,
                attempt=1,
                data=JobStateChangedData(from_state=JobState.SUBMITTED, to_state=JobState.QUEUED, cause_type="x"),
            ),
            id="state_changed",
        ),
        pytest.param(
            NodeRegistered(
                source="agent/node-1",
                node="node-1",
                data=NodeRegisteredData(gpu_model="H100", gpus=8, gpu_memory_gib=80),
            ),
            id="node_registered",
        ),
    ],
)
def test_an_event_the_lifecycle_does_not_handle_is_illegal(event):
    with pytest.raises(IllegalTransitionError, match="does not handle"):
        evolve(_queued(), event)


def test_an_illegal_transition_is_a_domain_error_not_a_transport_decision():
    assert not issubclass(IllegalTransitionError, PoisonEventError)  # the runtime decides acks, not the domain
    with pytest.raises(IllegalTransitionError, match="never submitted"):
        evolve(None, placed())


# --- purity --------------------------------------------------------------------------------------

_EVERY_STEP = [
    (None, submitted()),
    (_queued, waiting()),
    (_queued, placed()),
    (lambda: fold(submitted(), placed())[0], started(0)),
    (_running, exited(0)),
    (_running, exited(0, exit_code=1)),
    (_running, cancel()),
    (_running, ckpt_started(5)),
    (_succeeded, released()),
    (_failed, retry()),
]


@pytest.mark.parametrize(("view", "event"), _EVERY_STEP, ids=lambda x: getattr(x, "name", None))
def test_the_fold_does_not_change_its_input(view, event):
    before = view() if view is not None else None
    snapshot = before.model_dump() if before is not None else None
    event_snapshot = event.model_dump()
    after, _ = evolve(before, event)
    assert after is not before
    if before is not None:
        assert before.model_dump() == snapshot
    assert event.model_dump() == event_snapshot


@pytest.mark.parametrize(("view", "event"), _EVERY_STEP, ids=lambda x: getattr(x, "name", None))
def test_the_fold_is_deterministic(view, event):
    before = view() if view is not None else None
    assert evolve(before, event) == evolve(before, event)


def test_the_view_survives_its_json_round_trip():
    view, _ = evolve(_failed(), retry())
    assert JobView.model_validate_json(view.model_dump_json()) == view


# --- telemetry findings refine causes --------------------------------------------------------------


def test_a_finding_refines_the_cause_of_a_failed_attempt_and_keeps_what_the_exits_said():
    view, _ = fold(*START, exited(1, exit_code=None, signal=15), exited(0, exit_code=None, signal=15))
    assert view.current.cause is FailureCause.PLATFORM_ACTION
    view, transition = evolve(view, finding(1))
    assert transition is None
    assert view.state is JobState.FAILED
    assert view.current.cause is FailureCause.COMMUNICATION_FAILURE
    assert view.current.exit_cause is FailureCause.PLATFORM_ACTION
    assert view.current.cause_detail == (
        "ibp94s0 flapped on node-2 (telemetry finding v1; exits: rank 1 on node-2 was killed by signal 15)"
    )
    older, _ = evolve(view, finding(1, lane=Lane.HOST))  # the same version again: ignored
    assert older == view
    newer, _ = evolve(view, finding(2, lane=Lane.HOST))
    assert newer.current.cause is FailureCause.NODE_FAULT
    assert newer.current.exit_cause is FailureCause.PLATFORM_ACTION


def test_an_unexplained_exit_leaves_the_exits_cause_as_it_was():
    view, _ = fold(*START, exited(1, exit_code=3), exited(0, exit_code=None, signal=15))
    assert view.current.cause is FailureCause.USER_CODE_ERROR
    first = FindingCause(
        category="unexplained_exit", lane=Lane.PLATFORM, node="node-2", rank=1,
        summary="rank 1 exited with status 3 and no evidence explains it (node-2)",
    )  # fmt: skip
    data = JobFindingData(version=1, first_error=first, stage="unknown", confidence=0.7)
    after, _ = evolve(view, JobFinding(source="lanes/telemetry", data=data, **_keys(None, 15, {})))
    assert after.current.cause is FailureCause.USER_CODE_ERROR  # neither a platform action nor the node's fault
    assert after.current.finding_version == 1


def test_a_finding_before_the_end_gives_the_same_attempt_as_after():
    ending = (exited(1, exit_code=None, signal=15), exited(0, exit_code=None, signal=15))
    found = finding(1, seconds=9)
    before, transitions = fold(*START, found, *ending)
    after, _ = fold(*START, *ending, found)
    assert before.current == after.current
    ended = transitions[-1]
    assert ended is not None
    assert ended.cause is FailureCause.COMMUNICATION_FAILURE


def test_a_finding_never_overrides_a_user_cancel_or_a_success():
    cancelled, _ = fold(submitted(), cancel(), finding(1))
    assert cancelled.current.cause is FailureCause.USER_CANCEL
    succeeded, _ = fold(*START, exited(0), exited(1), finding(1))
    assert succeeded.current.cause is FailureCause.NORMAL_COMPLETION
    assert succeeded.current.finding_version == 1  # recorded all the same


def test_a_finding_for_an_old_attempt_refines_that_attempt_only():
    view, _ = evolve(_failed(), retry())
    view, transition = evolve(view, finding(1, attempt=1))
    assert transition is None
    assert view.attempts[0].cause is FailureCause.COMMUNICATION_FAILURE
    assert view.current.finding_version is None


def test_a_rank_event_from_a_node_the_rank_was_not_placed_on_is_refused():
    """Issue 34: node-1's agent may sign only events about node-1, so a forged exit of rank 1 (placed on node-2)
    names node-1; the fold refuses it, and the job goes on as its real ranks report."""
    view, _ = fold(submitted(), placed(), started(0), started(1))
    refusal = r"rank_exited\.v1 for rank 1 from node-1, but attempt 1 placed it on node-2"
    with pytest.raises(IllegalTransitionError, match=refusal):
        evolve(view, exited(1, exit_code=1, node="node-1"))
    after, transition = evolve(view, exited(1, exit_code=0))
    assert transition is None
    assert after.current.ranks[1].exited
