"""Recovery's test events: a job's submission, placement, progress, findings and end, at times after T0.

Shared by recovery's domain tests, its handler tests (on the in-memory store) and the settlement property.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from lanes_contract.events import (
    CheckpointSaved,
    CheckpointSavedData,
    FindingCause,
    Heartbeat,
    HeartbeatData,
    JobFinding,
    JobFindingData,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    Lane,
    RankAssignment,
    ResourcesReleased,
    ResourcesReleasedData,
)
from lanes_contract.jobs import FailureCause, JobSpec, JobState, Owners
from lanes_recovery.adapters.policies import default_policy

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
JOB = "job-1"
MODEL = "sha256:" + "11" * 32
DATA = "sha256:" + "22" * 32
CONFIG = "sha256:" + "33" * 32
POLICY = default_policy()
SPEC = JobSpec(
    name="train",
    workers=2,
    gpus_per_worker=4,
    model_version=MODEL,
    data_version=DATA,
    config_version=CONFIG,
    image="registry/train:1",
    owners=Owners(algorithm="ada", host="hal", platform="pat"),
)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def keys(attempt: int, seconds: float, **more: Any) -> dict[str, Any]:
    return {"source": "tests", "jobid": JOB, "attempt": attempt, "time": at(seconds)} | more


def submitted(spec: JobSpec = SPEC) -> JobSubmitted:
    return JobSubmitted(data=JobSubmittedData(spec=spec), **keys(1, 0))


def placed(attempt: int = 1, nodes: tuple[str, ...] = ("node-1", "node-2"), seconds: float = 1) -> JobPlaced:
    assignments = tuple(RankAssignment(rank=r, node=n, gpus=(0, 1, 2, 3)) for r, n in enumerate(nodes))
    return JobPlaced(data=JobPlacedData(assignments=assignments), **keys(attempt, seconds))


def heartbeat(step: int, seconds: float, attempt: int = 1, rank: int = 0) -> Heartbeat:
    return Heartbeat(data=HeartbeatData(step=step), **keys(attempt, seconds, rank=rank, node="node-1"))


def checkpoint(step: int, attempt: int = 1, seconds: float = 5, **versions: Any) -> CheckpointSaved:
    fields = {"model_version": MODEL, "data_version": DATA, "config_version": CONFIG, "image": "registry/train:1"}
    data = CheckpointSavedData(step=step, path=f"/ckpt/{step}", digest="sha256:" + f"{step:064x}", **fields | versions)
    return CheckpointSaved(data=data, **keys(attempt, seconds, rank=0, node="node-1"))


def finding(
    lane: Lane,
    category: str,
    node: str | None = "node-2",
    attempt: int = 1,
    version: int = 1,
    *,
    settled: bool = True,
    rank: int | None = None,
) -> JobFinding:
    first = FindingCause(category=category, lane=lane, node=node, rank=rank, summary=f"{category} on {node}")
    data = JobFindingData(version=version, first_error=first, stage="steady_state", confidence=0.9, settled=settled)
    return JobFinding(data=data, **keys(attempt, 20 + version, lane=lane))


def changed(to_state: JobState, attempt: int = 1, seconds: float = 30) -> JobStateChanged:
    data = JobStateChangedData(
        from_state=JobState.RUNNING, to_state=to_state, cause_type="x", cause=FailureCause.NODE_FAULT
    )
    return JobStateChanged(data=data, **keys(attempt, seconds))


def released(attempt: int = 1, seconds: float = 31) -> ResourcesReleased:
    return ResourcesReleased(data=ResourcesReleasedData(nodes=("node-1",), gpus=8), **keys(attempt, seconds))
