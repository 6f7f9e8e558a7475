"""A decision a later settled finding contradicts is superseded on the timeline (real servers, real recovery).

The test plays the upstream events itself (placement, failure, telemetry's findings, release): the unit under
test is recovery's reaction. Before the next attempt is placed, the wrongly cordoned node is made ready again
with the reason, the right one is cordoned and the retry avoids it; once the next attempt is placed, the
mismatch is escalated to the owner of the culprit's lane.
"""

from __future__ import annotations

import pytest
from support.recovery import node_events, policy, spec, stack, submit, wait_for

from lanes_contract.client import LanesClient
from lanes_contract.events import (
    FindingCause,
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
    RecoveryEscalated,
    RecoverySuperseded,
    ResourcesReleased,
    ResourcesReleasedData,
    RetryRequested,
)
from lanes_contract.jobs import FailureCause, JobState
from lanes_contract.topology import NodeState
from lanes_recovery.domain.policy import Backoff
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers


async def _placed(client: LanesClient, job_id: str, attempt: int, nodes: tuple[str, str]) -> None:
    assignments = tuple(RankAssignment(rank=r, node=n, gpus=(0,)) for r, n in enumerate(nodes))
    await client.publish(
        JobPlaced(source="tests", jobid=job_id, attempt=attempt, data=JobPlacedData(assignments=assignments))
    )


async def _finding(client: LanesClient, job_id: str, version: int, category: str, node: str) -> None:
    cause = FindingCause(category=category, lane=Lane.HOST, node=node, summary=f"{category} on {node}")
    data = JobFindingData(version=version, first_error=cause, stage="steady_state", confidence=0.9, settled=True)
    await client.publish(JobFinding(source="lanes/telemetry", jobid=job_id, attempt=1, lane=Lane.HOST, data=data))


async def _states(client: LanesClient, node: str) -> list[tuple[NodeState, str]]:
    return [(e.data.state, e.data.reason) for e in await node_events(client, node) if isinstance(e, NodeStateChanged)]


async def _failed(client: LanesClient, job_id: str) -> None:
    data = JobStateChangedData(
        from_state=JobState.PARTIALLY_FAILED, to_state=JobState.FAILED, cause_type="x", cause=FailureCause.NODE_FAULT
    )
    await client.publish(JobStateChanged(source="lanes/lifecycle", jobid=job_id, attempt=1, data=data))


async def test_a_settled_finding_that_moves_the_culprit_before_the_retry_replans_it(
    own_urls: ServerUrls, unique: str
) -> None:
    job_id, wrong, right = f"moved-{unique}", f"{unique}-n1", f"{unique}-n2"
    async with stack(own_urls, policy(backoff=Backoff(base_s=0))) as conns:
        client = LanesClient(conns.nc, "tests")
        await submit(client, job_id, spec())
        await _placed(client, job_id, 1, (wrong, right))
        await _finding(client, job_id, 1, "silent_node", wrong)
        await _failed(client, job_id)
        (first,) = await wait_for(client, job_id, RecoveryDecided)
        assert first.data.cordon == (wrong,)
        await _finding(client, job_id, 2, "oom_kill", right)
        (notice,) = await wait_for(client, job_id, RecoverySuperseded)
        assert notice.data.replanned
        assert notice.data.reason.startswith(f"decided on host/silent_node on {wrong} at v1; the settled finding v2")
        decisions = await wait_for(client, job_id, RecoveryDecided, 2)
        assert (decisions[1].data.finding_version, decisions[1].data.cordon) == (2, (right,))
        released = ResourcesReleasedData(nodes=(wrong, right), gpus=2)
        await client.publish(ResourcesReleased(source="tests", jobid=job_id, attempt=1, data=released))
        (retry,) = await wait_for(client, job_id, RetryRequested)
        assert retry.data.avoid_nodes == (right,)
        (ready,) = [
            e
            for e in await node_events(client, wrong)
            if isinstance(e, NodeStateChanged) and e.data.state is NodeState.READY
        ]
        assert ready.data.reason.startswith("uncordoned: decided on host/silent_node")
        assert any(
            isinstance(e, NodeStateChanged) and e.data.state is NodeState.CORDONED
            for e in await node_events(client, right)
        )


async def test_a_settled_finding_that_moves_the_culprit_after_the_next_placement_is_escalated(
    own_urls: ServerUrls, unique: str
) -> None:
    job_id, wrong, right = f"late-{unique}", f"{unique}-n1", f"{unique}-n2"
    async with stack(own_urls, policy(backoff=Backoff(base_s=0)), "lifecycle") as conns:
        client = LanesClient(conns.nc, "tests")
        await submit(client, job_id, spec())
        await _placed(client, job_id, 1, (wrong, right))
        await _finding(client, job_id, 1, "silent_node", wrong)
        await _failed(client, job_id)
        await wait_for(client, job_id, RecoveryDecided)
        released = ResourcesReleasedData(nodes=(wrong, right), gpus=2)
        await client.publish(ResourcesReleased(source="tests", jobid=job_id, attempt=1, data=released))
        await wait_for(client, job_id, RetryRequested)
        await _placed(client, job_id, 2, (right, f"{unique}-n3"))
        await wait_for(client, job_id, JobPlaced, attempt=2)
        await _finding(client, job_id, 2, "oom_kill", right)
        (escalated,) = await wait_for(client, job_id, RecoveryEscalated)
        assert escalated.data.owner == "hal"  # the spec's host owner
        assert f"names host/oom_kill on {right}" in escalated.data.reason
        assert len(await wait_for(client, job_id, RecoveryDecided)) == 1
