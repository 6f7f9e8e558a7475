"""Shared by the lifecycle's real-server tests and their child processes: a long job story and a runner."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from lanes_contract.events import (
    CheckpointSaved,
    CheckpointSavedData,
    CheckpointStarted,
    CheckpointStartedData,
    CommunicatorReady,
    CommunicatorReadyData,
    Event,
    Heartbeat,
    HeartbeatData,
    HoldRequested,
    HoldRequestedData,
    JobPlaced,
    JobPlacedData,
    JobSubmitted,
    JobSubmittedData,
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
from lanes_contract.jobs import JobSpec
from lanes_lifecycle.domain.job import IllegalTransitionError, JobView, Transition, evolve
from lanes_lifecycle.entrypoints.service import JOB_EVENTS, LIFECYCLE_INPUTS
from lanes_runtime.consumer import ConsumerSpec

WORKERS = 4
T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)


def lifecycle_spec(durable: str, job_id: str) -> ConsumerSpec:
    """The lifecycle's consumer, restricted to one job (`*`: every job), with short timings so redeliveries
    happen in a test."""
    subjects = tuple(f"lanes.job.{job_id}.{name}" for name in LIFECYCLE_INPUTS)
    return dataclasses.replace(
        JOB_EVENTS, durable=durable, subjects=subjects, ack_wait_s=1.0, redelivery_delays_s=(0.2,), max_deliver=20
    )


def long_story(job_id: str, total: int = 2000) -> list[Event]:
    """`total` events of one job: failing attempts retried (one held and resumed), with rejected strays,
    then a last attempt that runs to success and release. Times advance 10 ms per event."""
    events: list[Event] = []

    def add(cls: type[Event], attempt: int, rank: int | None = None, **fields: Any) -> None:
        keys: dict[str, Any] = {"source": "tests", "jobid": job_id, "attempt": attempt}
        if rank is not None:
            keys |= {"rank": rank, "node": f"node-{rank}"}
        events.append(cls(time=T0 + timedelta(milliseconds=10 * len(events)), **keys, **fields))

    placement = tuple(RankAssignment(rank=r, node=f"node-{r}", gpus=(0,)) for r in range(WORKERS))
    spec = JobSpec(name="long", workers=WORKERS, retry_budget=100)

    def start(attempt: int) -> None:
        add(JobPlaced, attempt, data=JobPlacedData(assignments=placement))
        for rank in range(WORKERS):
            add(RankStarted, attempt, rank, data=RankStartedData(pid=1000 + rank))
            add(RendezvousDone, attempt, rank, data=RendezvousDoneData(world_size=WORKERS))
        for rank in range(WORKERS):
            add(CommunicatorReady, attempt, rank, data=CommunicatorReadyData(backend="nccl"))

    def steps(attempt: int, count: int, first: int) -> None:
        for step in range(first, first + count):
            add(Heartbeat, attempt, step % WORKERS, data=HeartbeatData(step=step))
            if step % 25 == 0:
                add(CheckpointStarted, attempt, 0, data=CheckpointStartedData(step=step))
                digest = "sha256:" + f"{step:064x}"
                add(
                    CheckpointSaved,
                    attempt,
                    0,
                    data=CheckpointSavedData(step=step, path=f"/ckpt/{step}", digest=digest),
                )

    add(JobSubmitted, 1, data=JobSubmittedData(spec=spec))
    attempt = 1
    while len(events) < total - 250:
        start(attempt)
        steps(attempt, 120, first=attempt * 1000)
        add(RankExited, attempt, 2, data=RankExitedData(exit_code=1))  # partially failed
        add(Heartbeat, attempt, 0, data=HeartbeatData(step=attempt * 1000 + 500))
        for rank in (0, 1, 3):
            add(RankExited, attempt, rank, data=RankExitedData(exit_code=None, signal=15))  # failed
        add(JobPlaced, attempt, data=JobPlacedData(assignments=placement))  # a stray: rejected, on the timeline
        if attempt == 2:
            add(HoldRequested, attempt, data=HoldRequestedData(reason="look at rank 2", owner="ml-oncall"))
            add(ResourcesReleased, attempt, data=ResourcesReleasedData(nodes=("node-0",), gpus=WORKERS))
            add(ResumeRequested, attempt, data=RetryData(reason="fixed"))
        else:
            add(ResourcesReleased, attempt, data=ResourcesReleasedData(nodes=("node-0",), gpus=WORKERS))
            add(RetryRequested, attempt, data=RetryData(reason="again"))
        add(RankExited, attempt, 2, data=RankExitedData(exit_code=1))  # a late duplicate of an old attempt
        attempt += 1
    start(attempt)
    tail = WORKERS + 1
    first = attempt * 1000
    while len(events) < total - tail:
        add(Heartbeat, attempt, 0, data=HeartbeatData(step=first))
        first += 1
    for rank in range(WORKERS):
        add(RankExited, attempt, rank, data=RankExitedData(exit_code=0))
    add(ResourcesReleased, attempt, data=ResourcesReleasedData(nodes=("node-0",), gpus=WORKERS))
    assert len(events) == total
    return events


def clean_run(events: list[Event]) -> tuple[JobView, list[tuple[Transition, Event]], list[Event]]:
    """The pure fold of the events: final view, transitions with their causes, and the rejected events."""
    view: JobView | None = None
    transitions: list[tuple[Transition, Event]] = []
    rejected: list[Event] = []
    for event in events:
        try:
            view, transition = evolve(view, event)
        except IllegalTransitionError:
            rejected.append(event)
            continue
        if transition is not None:
            transitions.append((transition, event))
    assert view is not None
    return view, transitions, rejected
