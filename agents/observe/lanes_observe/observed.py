"""Events of an observed job: one that another system (Slurm, a launcher) places and runs.

Every id is derived from what the job is (its id, attempt, rank), never from when it was seen, so two
producers that observe the same fact (the Slurm adapter and `lanes run` inside the job both register its
placement) publish the same event id and JetStream stores it once; a producer that restarts and observes
the job again publishes nothing new.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

from lanes_contract.events import (
    Event,
    JobPlaced,
    JobPlacedData,
    JobSubmitted,
    JobSubmittedData,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    ResourcesReleased,
    ResourcesReleasedData,
    utc_now,
)
from lanes_contract.ids import derived_event_id
from lanes_contract.jobs import JobSpec, WorkloadClass

OBSERVED_RETRY_BUDGET = 100
"""Requeues are the outside system's decision: Lanes records each as an attempt and never refuses one."""
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_-]+")
_E = TypeVar("_E", bound=Event)


def token(text: str, *, fallback: str = "unnamed") -> str:
    """A subject-safe token from an outside name: `node-1.cluster` -> `node-1`, `my job!` -> `my-job`."""
    cleaned = _NOT_TOKEN.sub("-", text.split(".", 1)[0]).strip("-")[:128]
    return cleaned or fallback


def observed_id(job_id: str, attempt: int, cls: type[Event], key: str = "") -> str:
    """The id of an observed fact: the same whoever observes it, however often."""
    event_type = cls.model_fields["type"].default
    if cls is JobSubmitted:
        return derived_event_id(job_id, event_type)  # the id `lanes submit` gives a submission
    return derived_event_id(f"{job_id}/{attempt}", event_type, key)


def observed_event(
    cls: type[_E], *, job_id: str, attempt: int, source: str, key: str = "", time: datetime | None = None, **fields: Any
) -> _E:
    """An event of an observed job with its derived id."""
    return cls(
        id=observed_id(job_id, attempt, cls, key),
        source=source,
        jobid=job_id,
        attempt=attempt,
        time=time or utc_now(),
        **fields,
    )


def observed_spec(
    name: str, *, workers: int, managed_by: str, tenant: str = "default", pool: str = "default"
) -> JobSpec:
    """The spec of a job Lanes did not place: the gang's size and who manages it."""
    return JobSpec(
        name=token(name),
        tenant=token(tenant, fallback="default"),
        pool=token(pool, fallback="default"),
        workload_class=WorkloadClass.BATCH,
        workers=max(workers, 1),
        retry_budget=OBSERVED_RETRY_BUDGET,
        managed_by=managed_by,
    )


def submitted(job_id: str, spec: JobSpec, *, source: str, time: datetime | None = None) -> JobSubmitted:
    """The registration of an observed job (its first attempt)."""
    return observed_event(
        JobSubmitted, job_id=job_id, attempt=1, source=source, time=time, data=JobSubmittedData(spec=spec)
    )


def block_placement(nodes: Sequence[str], tasks: int) -> tuple[RankAssignment, ...]:
    """Ranks 0..tasks-1 spread over the nodes in blocks, as Slurm's default distribution lays out tasks."""
    if not nodes:
        return ()
    per_node, extra = divmod(max(tasks, 1), len(nodes))
    assignments: list[RankAssignment] = []
    for index, node in enumerate(nodes):
        count = per_node + (1 if index < extra else 0)
        first = len(assignments)
        assignments.extend(RankAssignment(rank=first + i, node=token(node), gpus=()) for i in range(count))
    return tuple(assignments)


def placed(
    job_id: str, attempt: int, assignments: tuple[RankAssignment, ...], *, source: str, time: datetime | None = None
) -> JobPlaced:
    """Where the outside system runs each rank of this attempt."""
    return observed_event(
        JobPlaced, job_id=job_id, attempt=attempt, source=source, time=time, data=JobPlacedData(assignments=assignments)
    )


def rank_started(
    job_id: str,
    attempt: int,
    rank: int,
    node: str,
    *,
    source: str,
    pid: int | None = None,
    time: datetime | None = None,
) -> RankStarted:
    """A rank's process started (pid None when the producer does not see the process)."""
    return observed_event(
        RankStarted,
        job_id=job_id,
        attempt=attempt,
        source=source,
        key=str(rank),
        time=time,
        node=token(node),
        rank=rank,
        data=RankStartedData(pid=pid),
    )


def exit_data(status: int) -> RankExitedData:
    """A process status as Python reports it (negative: killed by that signal)."""
    return RankExitedData(exit_code=None, signal=-status) if status < 0 else RankExitedData(exit_code=status)


STOPPED = RankExitedData(exit_code=None, signal=signal.SIGTERM)
"""How a rank ends that its launcher or scheduler stopped (torchelastic's teardown, a requeue, a cancel)."""


def rank_exited(
    job_id: str,
    attempt: int,
    rank: int,
    node: str,
    data: RankExitedData,
    *,
    source: str,
    time: datetime | None = None,
) -> RankExited:
    """A rank's process ended (the first report of a rank's exit is the one the lifecycle keeps)."""
    return observed_event(
        RankExited,
        job_id=job_id,
        attempt=attempt,
        source=source,
        key=str(rank),
        time=time,
        node=token(node),
        rank=rank,
        data=data,
    )


def released(
    job_id: str, attempt: int, nodes: Sequence[str], *, source: str, time: datetime | None = None
) -> ResourcesReleased:
    """The outside system freed the attempt's allocation."""
    data = ResourcesReleasedData(nodes=tuple(dict.fromkeys(token(n) for n in nodes)), gpus=0)
    return observed_event(ResourcesReleased, job_id=job_id, attempt=attempt, source=source, time=time, data=data)
