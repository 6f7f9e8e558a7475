"""Property tests of the lifecycle fold over random event sequences.

The sequences mix every input the lifecycle folds, for three attempts, with duplicates, ranks reordered
against each other and late events of old attempts. Events the state does not allow are rejected (as the
service does) and must leave the view untouched. After every step the view must be a legal state.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    JobSubmitted,
    JobSubmittedData,
    JobWaiting,
    JobWaitingData,
    Lane,
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
from lanes_contract.jobs import JobSpec, JobState, SuccessCriteria
from lanes_lifecycle.domain.job import ACTIVE, TERMINAL, UNPLACED, IllegalTransitionError, JobFlag, JobView, evolve

JOB = "prop-job"
T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)
WORKERS = 3
SPEC = JobSpec(name="prop", workers=WORKERS, retry_budget=2, success=SuccessCriteria(required_artifacts=("model",)))
PLACEMENT = tuple(RankAssignment(rank=r, node=f"node-{r}", gpus=(0,)) for r in range(WORKERS))


def _keys(attempt: int, rank: int | None = None) -> dict[str, Any]:
    keys: dict[str, Any] = {"source": "prop", "jobid": JOB, "attempt": attempt, "time": T0}
    if rank is not None:
        keys |= {"rank": rank, "node": f"node-{rank}"}
    return keys


def rank_script(attempt: int, rank: int, outcome: str) -> list[Event]:
    """What one rank reports, in its own order: start, rendezvous, ready, progress, exit."""
    exit_data = {
        "ok": RankExitedData(exit_code=0),
        "code": RankExitedData(exit_code=2),
        "killed": RankExitedData(exit_code=None, signal=9),
        "terminated": RankExitedData(exit_code=None, signal=15),
    }[outcome]
    k = _keys(attempt, rank)
    return [
        RankStarted(data=RankStartedData(pid=100 + rank), **k),
        RendezvousDone(data=RendezvousDoneData(world_size=WORKERS), **k),
        CommunicatorReady(data=CommunicatorReadyData(), **k),
        Heartbeat(data=HeartbeatData(step=10 * (rank + 1)), **k),
        RankExited(data=exit_data, **k),
    ]


def job_events(attempt: int) -> list[Event]:
    """Scheduler events and user commands for one attempt."""
    k = _keys(attempt)
    return [
        JobWaiting(data=JobWaitingData(reason="capacity_short"), **k),
        JobPlaced(data=JobPlacedData(assignments=PLACEMENT), **k),
        JobRejected(data=JobRejectedData(reason="spec_mismatch"), **k),
        ResourcesReleased(data=ResourcesReleasedData(nodes=("node-0",), gpus=WORKERS), **k),
        CancelRequested(data=CommandData(requested_by="prop"), **k),
        RetryRequested(data=RetryData(), **k),
        HoldRequested(data=HoldRequestedData(), **k),
        ResumeRequested(data=RetryData(), **k),
        CheckpointStarted(data=CheckpointStartedData(step=5), **_keys(attempt, 0)),
        CheckpointSaved(
            data=CheckpointSavedData(step=5, path="/ckpt/5", digest="sha256:" + "0" * 64), **_keys(attempt, 0)
        ),
        ArtifactProduced(data=ArtifactProducedData(artifact="model", path="/out/model"), **_keys(attempt, 0)),
        JobFinding(
            data=JobFindingData(
                version=1,
                first_error=FindingCause(category="gpu_xid", lane=Lane.HOST, summary="Xid 79 on node-1"),
                stage="steady_state",
                confidence=0.8,
            ),
            **k,
        ),
    ]


SUBMIT = JobSubmitted(data=JobSubmittedData(spec=SPEC), **_keys(1))
OUTCOMES = st.sampled_from(["ok", "ok", "ok", "ok", "ok", "code", "killed", "terminated"])


@st.composite
def interleaved_ranks(draw: st.DrawFn, attempt: int) -> list[Event]:
    """The ranks' scripts merged in a random order that keeps each rank's own order."""
    scripts = [rank_script(attempt, rank, draw(OUTCOMES)) for rank in range(WORKERS)]
    merged: list[Event] = []
    while any(scripts):
        pick = draw(st.sampled_from([i for i, s in enumerate(scripts) if s]))
        merged.append(scripts[pick].pop(0))
    return merged


@st.composite
def attempt_story(draw: st.DrawFn, attempt: int) -> list[Event]:
    """A plausible run of one attempt: wait, placement, ranks, progress, an optional cancel, the release."""
    waiting, placed, rejected, released, cancel, retry, hold, resume, ckpt_start, ckpt_saved, artifact, found = (
        job_events(attempt)
    )
    story: list[Event] = draw(st.sampled_from([[], [waiting]]))
    if draw(st.integers(0, 9)) == 0:
        return [*story, rejected, draw(st.sampled_from([retry, hold, released]))]
    story.append(placed)
    ranks = draw(interleaved_ranks(attempt))
    for extra in (ckpt_start, ckpt_saved, artifact, found):
        if draw(st.booleans()):
            ranks.insert(draw(st.integers(0, len(ranks))), extra)
    if draw(st.integers(0, 3)) == 0:
        ranks.insert(draw(st.integers(0, len(ranks))), cancel)
    story += ranks
    story.append(released)
    story += draw(st.sampled_from([[retry], [hold, resume], [hold], []]))
    return story


@st.composite
def event_sequences(draw: st.DrawFn) -> list[Event]:
    """Three attempts' stories, then noise: duplicates, late old-attempt events and random stray events."""
    body: list[Event] = []
    pool: list[Event] = []
    for attempt in (1, 2, 3):
        body += draw(attempt_story(attempt))
        pool += rank_script(attempt, draw(st.integers(0, WORKERS - 1)), draw(OUTCOMES)) + job_events(attempt)
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["duplicate", "late", "stray"]))
        if kind == "stray":
            body.insert(draw(st.integers(0, len(body))), draw(st.sampled_from(pool)))
            continue
        if not body:
            continue
        event = draw(st.sampled_from(body))
        at = body.index(event)
        # duplicate: the same event (same id) again later; late: the same event moved later (reordered)
        if kind == "late":
            body.pop(at)
        body.insert(draw(st.integers(at, len(body))), event)
    return [SUBMIT, *body]


def apply(view: JobView | None, event: Event) -> JobView | None:
    try:
        return evolve(view, event)[0]
    except IllegalTransitionError:
        return view


def assert_legal(view: JobView) -> None:
    assert view.state is not JobState.SUBMITTED
    assert view.history
    assert view.history[-1].state is view.state
    assert [a.number for a in view.attempts] == list(range(1, len(view.attempts) + 1))
    assert len(view.attempts) - 1 <= view.spec.retry_budget
    current = view.current
    assert current.state is view.state
    for old in view.attempts[:-1]:
        assert old.cause is not None
        assert old.ended_at is not None
        assert old.state in TERMINAL | {JobState.RELEASED, JobState.AWAITING_MANUAL}
    ranks = current.ranks.values()
    if view.state in TERMINAL | {JobState.RELEASED, JobState.AWAITING_MANUAL}:
        assert current.cause is not None
        assert current.ended_at is not None
    if view.state is JobState.SUCCEEDED:
        assert len(current.ranks) == WORKERS
        assert all(r.state == "succeeded" for r in ranks)
        assert "model" in current.artifacts
    if view.state is JobState.RUNNING:
        assert all(r.ready or r.exited for r in ranks)
    if view.state is JobState.PARTIALLY_FAILED:
        assert current.failed_ranks
        assert any(r.running for r in ranks)
    if view.state is JobState.CANCELLING:
        assert any(r.running for r in ranks)
    if view.state in ACTIVE | {JobState.CANCELLING}:
        assert len(current.placement) == WORKERS
    if view.state in UNPLACED:
        assert current.placement == ()
    assert (view.state is JobState.AWAITING_MANUAL) == (view.manual is not None)
    if JobFlag.CHECKPOINTING in view.flags:
        assert view.state in ACTIVE
    previous = None
    for span in view.history:
        assert span.state is not previous  # every recorded transition changes the state
        previous = span.state


S = JobState
LEGAL = {
    S.SUBMITTED: {S.QUEUED},
    S.QUEUED: {S.ADMITTED, S.FAILED, S.CANCELLED},
    S.RETRYING: {S.QUEUED, S.ADMITTED, S.FAILED, S.CANCELLED},
    S.ADMITTED: {S.STARTING, S.RUNNING, S.PARTIALLY_FAILED, S.SUCCEEDED, S.FAILED, S.CANCELLING, S.CANCELLED},
    S.STARTING: {S.RUNNING, S.PARTIALLY_FAILED, S.SUCCEEDED, S.FAILED, S.CANCELLING, S.CANCELLED},
    S.RUNNING: {S.PARTIALLY_FAILED, S.SUCCEEDED, S.FAILED, S.CANCELLING},
    S.PARTIALLY_FAILED: {S.FAILED, S.CANCELLING},
    S.CANCELLING: {S.CANCELLED},
    S.SUCCEEDED: {S.RELEASED},
    S.FAILED: {S.RELEASED, S.RETRYING, S.AWAITING_MANUAL},
    S.CANCELLED: {S.RELEASED, S.RETRYING, S.AWAITING_MANUAL},
    S.RELEASED: {S.RETRYING, S.AWAITING_MANUAL},
    S.AWAITING_MANUAL: {S.RETRYING, S.CANCELLED},  # resumed, or abandoned by its owner
}
"""The state machine's edges, written down independently of the fold."""


def assert_legal_history(view: JobView) -> None:
    states = [S.SUBMITTED, *(span.state for span in view.history)]
    for before, after in itertools.pairwise(states):
        assert after in LEGAL[before], f"{before} -> {after}"


PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(event_sequences())
def test_no_sequence_reaches_an_illegal_state(events):
    view = None
    for event in events:
        before = view
        view = apply(view, event)
        assert view is not None
        assert_legal(view)
        assert_legal_history(view)
        if before is not None and event.attempt is not None and event.attempt < before.current.number:
            # a late event of an old attempt is recorded against it and never moves the job
            assert view.state is before.state
            assert view.current == before.current
            assert view.history == before.history


@PROPERTY
@given(event_sequences())
def test_replaying_the_same_events_gives_the_same_view(events):
    first = second = None
    for event in events:
        first = apply(first, event)
    for event in events:
        second = apply(second, event)
    assert first == second
    assert first is not None
    assert JobView.model_validate_json(first.model_dump_json()) == first


@PROPERTY
@given(st.data())
def test_an_event_delivered_twice_in_a_row_changes_nothing_the_second_time(data):
    view = None
    for event in data.draw(event_sequences()):
        view = apply(view, event)
        assert apply(view, event) == view


@PROPERTY
@given(st.lists(OUTCOMES, min_size=WORKERS, max_size=WORKERS), st.randoms(use_true_random=False))
def test_the_order_of_ranks_against_each_other_does_not_change_the_outcome(outcomes, rnd):
    scripts = [rank_script(1, rank, outcome) for rank, outcome in enumerate(outcomes)]
    artifact = job_events(1)[-2]
    placed = job_events(1)[1]

    def run(order: list[int]) -> JobView:
        queues = [list(s) for s in scripts]
        view = apply(apply(apply(None, SUBMIT), placed), artifact)
        for pick in order:
            view = apply(view, queues[pick].pop(0))
        assert view is not None
        return view

    order = [rank for rank, script in enumerate(scripts) for _ in script]
    by_rank = run(order)
    rnd.shuffle(order)
    shuffled = run(order)
    assert shuffled.state is by_rank.state
    assert by_rank.state in {JobState.SUCCEEDED, JobState.FAILED}
    assert (shuffled.current.cause is None) == (by_rank.current.cause is None)
    assert shuffled.current.ranks == by_rank.current.ranks
    assert (by_rank.state is JobState.SUCCEEDED) == all(o == "ok" for o in outcomes)
