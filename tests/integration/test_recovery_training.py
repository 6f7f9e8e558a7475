"""Recovery of training jobs on real NATS + PostgreSQL, with the real scheduler, lifecycle and telemetry.

The ranks are played by a scripted launcher that publishes what a real one would (starts, heartbeats,
checkpoint records of real files with their digests, exits); telemetry elects the first error from the
evidence a node agent would send; recovery decides; the scheduler and the lifecycle carry the decision out.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.recovery import (
    CONFIG,
    Checkpoint,
    ScriptedLauncher,
    events_of,
    node_events,
    policy,
    register_nodes,
    sequenced,
    spec,
    stack,
    submit,
    wait_for,
    write_checkpoint,
)
from support.waiting import eventually

from lanes_contract.client import LanesClient
from lanes_contract.events import (
    AttemptRequested,
    EvidenceCategory,
    EvidenceData,
    HostEvidence,
    JobPlaced,
    JobStateChanged,
    NodeStateChanged,
    RecoveryAction,
    RecoveryDecided,
    ResourcesReleased,
    RetryRequested,
)
from lanes_contract.jobs import JobState
from lanes_contract.topology import NodeState
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers
NODES = ("gpu-a", "gpu-b", "gpu-c", "gpu-d")


async def test_an_oom_killed_training_job_cordons_the_node_and_resumes_from_its_last_verified_checkpoint_elsewhere(
    own_urls: ServerUrls, tmp_path: Path, unique: str
) -> None:
    job_id = f"train-{unique}"
    async with stack(own_urls, policy(backoff={"base_s": 0.2}), "scheduler", "lifecycle", "telemetry") as conns:
        client = LanesClient(conns.nc, "tests")
        await register_nodes(conns, client, NODES)
        await submit(client, job_id, spec())
        victim, corrupted = await _first_attempt_killed_by_the_oom_killer(client, job_id, tmp_path)

        requested = (await wait_for(client, job_id, AttemptRequested, attempt=2))[0]
        assert requested.data.resume_step == 100
        assert requested.data.avoid_nodes == (victim,)  # carried by the request, not left to the cordon's timing
        second_placement = (await wait_for(client, job_id, JobPlaced, attempt=2))[0]
        assert victim not in second_placement.data.nodes  # the cordoned node is avoided
        second = ScriptedLauncher(client, second_placement)
        await second.start()
        await second.steps(range(100, 401, 100))
        for rank in second.ranks:
            await second.exit(rank, exit_code=0)
        await wait_for(client, job_id, JobStateChanged, data__to_state=JobState.SUCCEEDED)

        decisions = await events_of(client, job_id, RecoveryDecided)
        assert len(decisions) == 1
        decided = decisions[0].data
        assert decided.action is RecoveryAction.RESUME
        assert decided.first_error == "host/oom_kill"
        assert decided.cordon == (victim,)
        assert (decided.owner, decided.owner_lane.value) == ("hal", "host")
        assert decided.checkpoint is not None
        assert decided.checkpoint.step == 100 == decided.resume_step
        refused = {(r.checkpoint.step, r.field): r for r in decided.refused}
        assert set(refused) == {(200, "digest"), (300, "config_version")}
        assert refused[200, "digest"].expected == corrupted.digest
        assert refused[300, "config_version"].expected == CONFIG
        assert decided.lost_work is not None
        assert (decided.lost_work.steps, decided.lost_work.gpus) == (340 - 100, 8)
        assert decided.lost_work.gpu_hours is not None
        assert decided.expects == "io.lanes.job.attempt_requested.v1"
        assert f"lanes topology state {victim} ready" in decided.rollback
        assert (decided.policy, decided.policy_version) == ("lanes-default", 99)
        finding_ids = {decided.finding_id}
        assert decisions[0].causationid in finding_ids

        cordons = [e for e in await node_events(client, victim) if isinstance(e, NodeStateChanged)]
        assert [(c.data.state, c.lane.value) for c in cordons] == [(NodeState.CORDONED, "host")]
        assert "owner hal" in cordons[0].data.reason

        timeline = await sequenced(client, job_id)
        seq_of_release = next(
            s for s, e in timeline if isinstance(e, ResourcesReleased) and e.attempt == 1
        )  # the failed attempt's allocation
        retries = [(s, e) for s, e in timeline if isinstance(e, RetryRequested)]
        assert len(retries) == 1
        retry_seq, retry = retries[0]
        assert retry_seq > seq_of_release
        assert (retry.attempt, retry.data.resume_step, retry.data.requested_by) == (1, 100, "lanes/recovery")
        assert retry.data.avoid_nodes == (victim,)
        assert retry.causationid == decisions[0].id


async def test_a_new_attempt_is_never_requested_before_the_failed_attempts_resources_are_released(
    own_urls: ServerUrls, unique: str
) -> None:
    """Without the scheduler nothing releases attempt 1: the decision is made, the retry waits for the release."""
    from lanes_contract.events import (  # noqa: PLC0415 - only this test plays the scheduler and telemetry
        FindingCause,
        JobFinding,
        JobFindingData,
        JobPlacedData,
        Lane,
        RankAssignment,
        ResourcesReleasedData,
    )

    job_id = f"gate-{unique}"
    async with stack(own_urls, policy(backoff={"base_s": 0}), "lifecycle") as conns:
        client = LanesClient(conns.nc, "tests")
        await submit(client, job_id, spec())
        assignments = (RankAssignment(rank=0, node="n-1", gpus=(0,)), RankAssignment(rank=1, node="n-2", gpus=(0,)))
        await client.publish(
            JobPlaced(source="tests", jobid=job_id, attempt=1, data=JobPlacedData(assignments=assignments))
        )
        placed = (await wait_for(client, job_id, JobPlaced))[0]
        ranks = ScriptedLauncher(client, placed)
        await ranks.start()
        await ranks.steps([10, 20])
        cause = FindingCause(category="gpu_xid", lane=Lane.HOST, node="n-2", summary="Xid 79 on n-2")
        finding = JobFindingData(version=1, first_error=cause, stage="steady_state", confidence=0.9, settled=True)
        await client.publish(JobFinding(source="tests", jobid=job_id, attempt=1, lane=Lane.HOST, data=finding))
        await ranks.exit(1, exit_code=None, signal=signal.SIGKILL)
        await ranks.exit(0, exit_code=None, signal=signal.SIGTERM)

        decided = (await wait_for(client, job_id, RecoveryDecided))[0]
        assert decided.data.action is RecoveryAction.RESUME
        assert decided.data.resume_step == 0  # no checkpoint was ever recorded: from the start, and it says so
        assert "never recorded a checkpoint" in decided.data.reason

        async def settled() -> bool:
            known = await conns.pool.fetchval("SELECT knowledge FROM recovery_jobs WHERE job_id = $1", job_id)
            return known is not None and '"pending":{' in known.replace(" ", "")

        await eventually(settled, what="the owed retry recorded")
        assert await events_of(client, job_id, RetryRequested) == []  # decided, but attempt 1 still holds its GPUs

        released = ResourcesReleasedData(nodes=("n-1", "n-2"), gpus=2)
        await client.publish(ResourcesReleased(source="tests", jobid=job_id, attempt=1, data=released))
        retry = (await wait_for(client, job_id, RetryRequested))[0]
        assert retry.data.resume_step == 0
        requested = (await wait_for(client, job_id, AttemptRequested, attempt=2))[0]
        assert requested.data.resume_step == 0
        timeline = await sequenced(client, job_id)
        order = [type(e).__name__ for _, e in timeline if isinstance(e, RecoveryDecided | ResourcesReleased)]
        order += [type(e).__name__ for _, e in timeline if isinstance(e, RetryRequested)]
        assert order == ["RecoveryDecided", "ResourcesReleased", "RetryRequested"]


async def _first_attempt_killed_by_the_oom_killer(
    client: LanesClient, job_id: str, tmp_path: Path
) -> tuple[str, Checkpoint]:
    """Attempt 1 runs to step 340 with checkpoints 100 (good), 200 (torn afterwards) and 300 (wrong config),
    then the OOM killer kills rank 1 and the launcher tears rank 0 down. Returns rank 1's node and the torn one."""
    placed = (await wait_for(client, job_id, JobPlaced, attempt=1))[0]
    first = ScriptedLauncher(client, placed)
    await first.start()
    await first.steps(range(0, 101, 20))
    good = write_checkpoint(tmp_path, 100)
    await first.checkpoint(good)
    await first.steps(range(120, 201, 20))
    corrupted = write_checkpoint(tmp_path, 200)
    await first.checkpoint(corrupted)
    corrupted.path.write_bytes(b"torn write")  # the file no longer has the digest its record holds
    await first.steps(range(220, 301, 20))
    await first.checkpoint(write_checkpoint(tmp_path, 300), config_version="sha256:" + "99" * 32)
    await first.steps(range(320, 341, 20))
    victim = first.node_of(1)
    oom = EvidenceData(
        category=EvidenceCategory.OOM_KILL,
        summary="Out of memory: Killed process 4242 (python)",
        lines=("kernel: Out of memory: Killed process 4242 (python) total-vm:88GB",),
        pid=4242,
    )
    await client.publish(HostEvidence(source=f"agent/{victim}", node=victim, data=oom))
    await first.exit(1, exit_code=None, signal=signal.SIGKILL)
    await first.exit(0, exit_code=None, signal=signal.SIGTERM)  # torn down by its launcher

    return victim, corrupted
