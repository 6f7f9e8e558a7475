"""Recovery killed with SIGKILL while deciding: after restarts, exactly one decision per finding on the log.

The recovery consumer runs as a real child process (recovery_child.py) against real NATS and PostgreSQL.
It kills itself at each point of a decision in turn: after writing the decision but before the commit,
after the commit but before publishing it, and after publishing it but before the outbox row is deleted
and the event acknowledged. The upstream events (submission, placement, heartbeats, checkpoints, finding,
failure, release) are published by the test: they are the input recovery decides on.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from support.recovery import events_of, node_events, spec, submit
from support.waiting import eventually

from lanes_contract.client import LanesClient
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
    Lane,
    NodeStateChanged,
    RankAssignment,
    RecoveryDecided,
    ResourcesReleased,
    ResourcesReleasedData,
    RetryRequested,
)
from lanes_contract.jobs import FailureCause, JobState
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import create_pool

pytestmark = pytest.mark.real_servers
CHILD = Path(__file__).parent / "recovery_child.py"
IMAGE_FIELDS = {
    "model_version": "sha256:" + "11" * 32,
    "data_version": "sha256:" + "22" * 32,
    "config_version": "sha256:" + "33" * 32,
    "image": "registry.local/train:1",
}


async def _failed_attempt(client: LanesClient, job_id: str) -> None:
    """A job whose attempt 1 ran to step 250 with a checkpoint at 200, and died of a GPU Xid on its node."""
    node = f"{job_id}-n2"
    await submit(client, job_id, spec())
    keys: dict[str, Any] = {"source": "tests", "jobid": job_id, "attempt": 1}
    assignments = (RankAssignment(rank=0, node=f"{job_id}-n1", gpus=(0,)), RankAssignment(rank=1, node=node, gpus=(0,)))
    await client.publish(JobPlaced(data=JobPlacedData(assignments=assignments), **keys))
    for step in (100, 200, 250):
        await client.publish(Heartbeat(data=HeartbeatData(step=step), rank=0, **keys))
    saved = CheckpointSavedData(step=200, path=f"s3://ckpt/{job_id}/200", digest="sha256:" + "ab" * 32, **IMAGE_FIELDS)
    await client.publish(CheckpointSaved(data=saved, rank=0, **keys))
    cause = FindingCause(category="gpu_xid", lane=Lane.HOST, node=node, summary=f"Xid 79 on {node}")
    finding = JobFindingData(version=1, first_error=cause, stage="steady_state", confidence=0.9, settled=True)
    await client.publish(JobFinding(lane=Lane.HOST, data=finding, **keys | {"source": "lanes/telemetry"}))
    failed = JobStateChangedData(
        from_state=JobState.PARTIALLY_FAILED, to_state=JobState.FAILED, cause_type="x", cause=FailureCause.NODE_FAULT
    )
    await client.publish(JobStateChanged(data=failed, **keys | {"source": "lanes/lifecycle"}))
    released = ResourcesReleasedData(nodes=(f"{job_id}-n1", node), gpus=2)
    await client.publish(ResourcesReleased(data=released, **keys | {"source": "lanes/scheduler"}))


def _start(urls: ServerUrls, durable: str, jobs: list[str], point: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), urls.nats_url, urls.database_url, durable, ",".join(jobs), point],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


async def _decisions_in_db(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM recovery_decisions"))


@pytest.mark.slow
async def test_sigkill_while_deciding_still_gives_exactly_one_decision_per_finding(
    lanes: LanesClient, urls: ServerUrls, unique: str
) -> None:
    jobs = [f"crash-{unique}-{n}" for n in range(3)]
    durable = f"recovery-crash-{unique}"
    for job_id in jobs:
        await _failed_attempt(lanes, job_id)

    for point in ("decide", "publish", "published"):
        child = _start(urls, durable, jobs, point)
        code = await asyncio.to_thread(child.wait, 120)
        assert code == -signal.SIGKILL, f"the child meant to die at {point!r} exited with {code}"

    survivor = _start(urls, durable, jobs, "none")
    pool = await create_pool(urls.database_url, max_size=2)
    try:

        async def all_retried() -> bool:
            return all([await events_of(lanes, job_id, RetryRequested) for job_id in jobs])

        await eventually(all_retried, timeout_s=120, what="a retry for every job")
        assert await _decisions_in_db(pool) == len(jobs)
    finally:
        survivor.send_signal(signal.SIGKILL)
        await asyncio.to_thread(survivor.wait, 30)
        await pool.close()

    for job_id in jobs:
        decisions = await events_of(lanes, job_id, RecoveryDecided)
        findings = await events_of(lanes, job_id, JobFinding)
        assert Counter(d.data.finding_id for d in decisions) == {findings[0].id: 1}
        assert decisions[0].data.checkpoint is not None
        assert decisions[0].data.checkpoint.step == 200
        retries = await events_of(lanes, job_id, RetryRequested)
        assert [(r.attempt, r.data.resume_step) for r in retries] == [(1, 200)]
        cordons = [e for e in await node_events(lanes, f"{job_id}-n2") if isinstance(e, NodeStateChanged)]
        assert len(cordons) == 1
