"""Unit tests for the lifecycle's job state machine, ``evolve(view, event)``: a pure fold over events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from lanes_common.errors import PoisonEventError
from lanes_common.events import (
    Event,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    JobWaiting,
    JobWaitingData,
    NodeRegistered,
    NodeRegisteredData,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    ResourcesReleased,
    ResourcesReleasedData,
)
from lanes_common.jobs import JobSpec, JobState
from lanes_lifecycle.domain.job import IllegalTransitionError, JobView, Transition, evolve

T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)
JOB = "job-1"
SPEC = JobSpec(name="train-llm", workers=2, gpus_per_worker=4)
ASSIGNMENTS = (
    RankAssignment(rank=0, node="node-1", gpus=(0, 1, 2, 3)),
    RankAssignment(rank=1, node="node-2", gpus=(0, 1, 2, 3)),
)


def _at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


def submitted(**keys: Any) -> JobSubmitted:
    return JobSubmitted(source="lanes/api", jobid=JOB, attempt=1, time=_at(0), data=JobSubmittedData(spec=SPEC), **keys)


def waiting(reason: str = "capacity_short", **keys: Any) -> JobWaiting:
    fields: dict[str, Any] = {"jobid": JOB, "attempt": 1, "time": _at(1)} | keys
    return JobWaiting(source="lanes/scheduler", data=JobWaitingData(reason=reason), **fields)


def placed(**keys: Any) -> JobPlaced:
    fields: dict[str, Any] = {"jobid": JOB, "attempt": 1, "time": _at(2)} | keys
    return JobPlaced(source="lanes/scheduler", data=JobPlacedData(assignments=ASSIGNMENTS), **fields)


def started(rank: int, seconds: int = 3, **keys: Any) -> RankStarted:
    fields: dict[str, Any] = {
        "jobid": JOB,
        "attempt": 1,
        "node": f"node-{rank + 1}",
        "rank": rank,
        "time": _at(seconds),
    } | keys
    return RankStarted(source=f"agent/node-{rank + 1}", data=RankStartedData(pid=1000 + rank), **fields)


def exited(rank: int, exit_code: int | None = 0, signal: int | None = None, seconds: int = 10, **keys: Any):
    fields: dict[str, Any] = {
        "jobid": JOB,
        "attempt": 1,
        "node": f"node-{rank + 1}",
        "rank": rank,
        "time": _at(seconds),
    } | keys
    return RankExited(
        source=f"agent/node-{rank + 1}", data=RankExitedData(exit_code=exit_code, signal=signal), **fields
    )


def released(**keys: Any) -> ResourcesReleased:
    fields: dict[str, Any] = {"jobid": JOB, "attempt": 1, "time": _at(20)} | keys
    return ResourcesReleased(
        source="lanes/scheduler", data=ResourcesReleasedData(nodes=("node-1", "node-2"), gpus=8), **fields
    )


def fold(*events: Event) -> tuple[JobView, list[Transition | None]]:
    view: JobView | None = None
    transitions: list[Transition | None] = []
    for event in events:
        view, transition = evolve(view, event)
        transitions.append(transition)
    assert view is not None
    return view, transitions


def _step(view: JobView | None, event: Event) -> tuple[JobView, Transition | None]:
    return evolve(view, event)


def _moved(transition: Transition | None, from_state: JobState | None, to_state: JobState) -> Transition:
    assert transition is not None
    assert (transition.from_state, transition.to_state) == (from_state, to_state)
    return transition


# --- the skeleton path ---------------------------------------------------------------------------


def test_the_skeleton_path_from_submitted_to_released():
    view, transition = _step(None, submitted())
    assert view.job_id == JOB
    assert view.spec == SPEC
    assert view.state is JobState.QUEUED
    assert len(view.attempts) == 1
    assert view.current.number == 1
    assert view.current.state is JobState.QUEUED
    assert _moved(transition, JobState.SUBMITTED, JobState.QUEUED).reason == "submitted"

    view, transition = _step(view, waiting("capacity_short"))
    assert transition is None
    assert view.state is JobState.QUEUED
    assert view.wait_reason == "capacity_short"

    view, transition = _step(view, placed())
    _moved(transition, JobState.QUEUED, JobState.ADMITTED)
    assert view.state is JobState.ADMITTED
    assert view.current.state is JobState.ADMITTED
    assert view.current.placement == ASSIGNMENTS
    assert view.wait_reason is None

    view, transition = _step(view, started(0, seconds=3))
    assert _moved(transition, JobState.ADMITTED, JobState.RUNNING).reason == "rank 0 started"
    assert view.state is JobState.RUNNING
    assert view.current.started_ranks == {0}
    assert view.current.started_at == _at(3)

    view, transition = _step(view, started(1, seconds=4))
    assert transition is None
    assert view.current.started_ranks == {0, 1}
    assert view.current.started_at == _at(3)  # the first start, not the last

    view, transition = _step(view, exited(1, seconds=10))
    assert transition is None  # one of two ranks is not the job
    assert view.state is JobState.RUNNING
    assert view.current.succeeded_ranks == {1}

    view, transition = _step(view, exited(0, seconds=11))
    assert _moved(transition, JobState.RUNNING, JobState.SUCCEEDED).reason == "all ranks exited 0"
    assert view.state is JobState.SUCCEEDED
    assert view.current.state is JobState.SUCCEEDED
    assert view.current.succeeded_ranks == {0, 1}
    assert view.current.failed_ranks == frozenset()
    assert view.current.ended_at == _at(11)
    assert view.current.cause == "all ranks exited 0"

    view, transition = _step(view, released())
    assert _moved(transition, JobState.SUCCEEDED, JobState.RELEASED).reason == "8 GPUs released"
    assert view.state is JobState.RELEASED
    assert view.current.state is JobState.RELEASED
    assert view.current.cause == "all ranks exited 0"  # why the attempt ended survives the release


def test_a_job_can_be_placed_without_waiting_first():
    view, transitions = fold(submitted(), placed())
    assert view.state is JobState.ADMITTED
    assert [t.to_state for t in transitions if t] == [JobState.QUEUED, JobState.ADMITTED]


def test_a_repeated_wait_updates_the_reason():
    view, _ = fold(submitted(), waiting("capacity_short"), waiting("spec_mismatch"))
    assert view.wait_reason == "spec_mismatch"
    assert view.state is JobState.QUEUED


def test_a_repeated_rank_exit_does_not_count_twice():
    view, transitions = fold(submitted(), placed(), started(0), started(1), exited(0), exited(0))
    assert view.state is JobState.RUNNING
    assert transitions[-1] is None
    assert view.current.succeeded_ranks == {0}


# --- failures ------------------------------------------------------------------------------------


def test_a_non_zero_exit_fails_the_job_with_rank_and_node_in_the_reason():
    view, transitions = fold(submitted(), placed(), started(0), started(1), exited(1, exit_code=137, seconds=9))
    transition = _moved(transitions[-1], JobState.RUNNING, JobState.FAILED)
    assert "rank 1" in transition.reason
    assert "node-2" in transition.reason
    assert "exit code 137" in transition.reason
    assert view.state is JobState.FAILED
    assert view.current.state is JobState.FAILED
    assert view.current.failed_ranks == {1}
    assert view.current.ended_at == _at(9)
    assert view.current.cause == transition.reason


def test_a_rank_killed_by_a_signal_fails_the_job():
    _, transitions = fold(submitted(), placed(), started(0), exited(0, exit_code=None, signal=9))
    transition = _moved(transitions[-1], JobState.RUNNING, JobState.FAILED)
    assert transition.reason == "rank 0 on node-1 ended with signal 9"


def test_a_failure_wins_over_ranks_that_already_succeeded():
    view, transitions = fold(submitted(), placed(), started(0), started(1), exited(0), exited(1, exit_code=1))
    _moved(transitions[-1], JobState.RUNNING, JobState.FAILED)
    assert view.current.succeeded_ranks == {0}
    assert view.current.failed_ranks == {1}


def test_later_exits_of_a_failed_attempt_are_recorded_without_a_transition():
    view, _ = fold(submitted(), placed(), started(0), started(1), exited(1, exit_code=2, seconds=9))
    after, transition = evolve(view, exited(0, exit_code=143, seconds=12))
    assert transition is None
    assert after.state is JobState.FAILED
    assert after.current.failed_ranks == {0, 1}
    assert after.current.ended_at == _at(9)  # the attempt ended at the first failure
    after, transition = evolve(after, released())
    _moved(transition, JobState.FAILED, JobState.RELEASED)


# --- illegal transitions -------------------------------------------------------------------------


def _queued() -> JobView:
    return fold(submitted())[0]


def _running() -> JobView:
    return fold(submitted(), placed(), started(0))[0]


def _succeeded() -> JobView:
    return fold(submitted(), placed(), started(0), started(1), exited(0), exited(1))[0]


def _released() -> JobView:
    return fold(submitted(), placed(), started(0), started(1), exited(0), exited(1), released())[0]


@pytest.mark.parametrize(
    "event",
    [placed(), waiting(), started(0), exited(0), released()],
    ids=lambda event: event.name,
)
def test_an_event_for_an_unknown_job_is_illegal(event):
    with pytest.raises(IllegalTransitionError, match="never submitted"):
        evolve(None, event)


@pytest.mark.parametrize("view", [_queued, _running, _succeeded, _released], ids=lambda f: f.__name__.strip("_"))
def test_a_second_submit_is_illegal(view):
    with pytest.raises(IllegalTransitionError, match="already submitted"):
        evolve(view(), submitted())


@pytest.mark.parametrize(
    ("view", "event"),
    [
        (_queued, placed(attempt=2)),
        (_queued, waiting(attempt=2)),
        (_running, started(1, attempt=2)),
        (_running, exited(0, attempt=3)),
        (_succeeded, released(attempt=2)),
    ],
    ids=["placed", "waiting", "rank_started", "rank_exited", "resources_released"],
)
def test_an_event_for_another_attempt_is_illegal(view, event):
    with pytest.raises(IllegalTransitionError, match="current attempt is 1"):
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
        pytest.param(_queued, started(0), id="rank-start-before-placement"),
        pytest.param(_succeeded, started(0), id="rank-start-after-success"),
        pytest.param(_queued, exited(0), id="rank-exit-before-placement"),
        pytest.param(lambda: fold(submitted(), placed())[0], exited(0), id="rank-exit-before-any-start"),
        pytest.param(_succeeded, exited(0), id="rank-exit-after-success"),
        pytest.param(_running, released(), id="release-of-a-running-job"),
        pytest.param(_queued, released(), id="release-of-a-queued-job"),
        pytest.param(_released, released(), id="second-release"),
    ],
)
def test_an_event_the_state_does_not_allow_is_illegal(view, event):
    before = view()
    with pytest.raises(IllegalTransitionError, match=f"not allowed for job {JOB} in state {before.state}"):
        evolve(before, event)


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
    view = _running()
    with pytest.raises(IllegalTransitionError, match="has no rank"):
        evolve(view, event)


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


def test_an_illegal_transition_is_a_poison_event_that_is_never_retried():
    assert issubclass(IllegalTransitionError, PoisonEventError)
    with pytest.raises(IllegalTransitionError) as caught:
        evolve(None, placed())
    assert caught.value.retryable is False


# --- purity --------------------------------------------------------------------------------------

_EVERY_STEP = [
    (None, submitted()),
    (_queued, waiting()),
    (_queued, placed()),
    (lambda: fold(submitted(), placed())[0], started(0)),
    (_running, started(1)),
    (_running, exited(0)),
    (_running, exited(0, exit_code=1)),
    (lambda: fold(submitted(), placed(), started(0), exited(0, exit_code=1))[0], exited(1)),
    (_succeeded, released()),
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


def test_a_rejected_event_leaves_the_view_as_it_was():
    view = _running()
    snapshot = view.model_dump()
    with pytest.raises(IllegalTransitionError):
        evolve(view, placed())
    assert view.model_dump() == snapshot
