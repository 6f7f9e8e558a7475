"""Recovery per workload class and on the non-recoverable path, on real servers with the real services.

Inference and evaluation run with the scheduler, lifecycle and telemetry; the manual path runs them too and
is driven by `lanes recover` as a real process. Where a test needs a finding or a release at a precise
moment it publishes that upstream event itself (the unit under test is recovery's reaction to it).
"""

from __future__ import annotations

import asyncio
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from support.cli import run_lanes_async
from support.recovery import (
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
    CancelRequested,
    EvidenceCategory,
    EvidenceData,
    FindingCause,
    HoldRequested,
    HostEvidence,
    JobFinding,
    JobFindingData,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    Lane,
    ManualAction,
    NodeStateChanged,
    PlatformEvidence,
    ProcessEvidence,
    RankAssignment,
    RankExited,
    RankExitedData,
    RecoveryAction,
    RecoveryDecided,
    RecoveryEscalated,
    ReplicaState,
    ReplicaStateChanged,
    ResourcesReleased,
    ResourcesReleasedData,
    ResumeRequested,
    RetryRequested,
    TransitionRejected,
    utc_now,
)
from lanes_contract.jobs import JobSpec, JobState, ProtectionMode, ServingSpec, WorkloadClass
from lanes_contract.topology import NodeState
from lanes_recovery.domain.policy import CordonBudget
from lanes_recovery.entrypoints.timers import RecoveryTimers
from lanes_recovery.service_layer.handlers import Recovery
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers
NODES = ("gpu-a", "gpu-b", "gpu-c", "gpu-d")


async def _evidence(client: LanesClient, cls: type[Any], node: str, **data: Any) -> None:
    await client.publish(cls(source=f"agent/{node}", node=node, data=EvidenceData(**data)))


# --- inference -----------------------------------------------------------------------------------


REPLICA_SPEC = JobSpec(
    name="tiny-chat",
    workload_class=WorkloadClass.INFERENCE,
    workers=1,
    gpus_per_worker=4,
    serving=ServingSpec(model="tiny-chat", version="v7", protection=ProtectionMode.QUEUE, retry_after_s=3),
)
"""One replica of tiny-chat v7 on 4 GPUs."""


async def _started_replica(conns: Connections, client: LanesClient, job_id: str) -> ScriptedLauncher:
    """Submit `REPLICA_SPEC` as `job_id` on the registered nodes and start its one rank where it was placed."""
    await register_nodes(conns, client, NODES)
    await submit(client, job_id, REPLICA_SPEC)
    placed = (await wait_for(client, job_id, JobPlaced, attempt=1))[0]
    replica = ScriptedLauncher(client, placed)
    await replica.start()
    return replica


async def test_an_inference_replica_on_a_failed_gpu_leaves_rotation_and_is_replaced_with_the_same_model_version(
    own_urls: ServerUrls, unique: str
) -> None:
    job_id = f"serve-{unique}"
    async with stack(own_urls, policy(), "scheduler", "lifecycle", "telemetry") as conns:
        client = LanesClient(conns.nc, "tests")
        replica = await _started_replica(conns, client, job_id)
        node = replica.node_of(0)
        await _evidence(
            client,
            HostEvidence,
            node,
            category=EvidenceCategory.GPU_XID,
            summary="Xid 79: GPU fell off the bus",
            xid=79,
        )
        await replica.exit(0, exit_code=None, signal=signal.SIGBUS)

        second = (await wait_for(client, job_id, JobPlaced, attempt=2))[0]
        assert node not in second.data.nodes
        decided = (await events_of(client, job_id, RecoveryDecided))[0]
        assert decided.data.action is RecoveryAction.REPLACE_REPLICA
        assert decided.data.protection is ProtectionMode.QUEUE
        assert "Retry-After 3 s" in decided.data.reason
        assert decided.data.lost_work is None
        outs = await events_of(client, job_id, ReplicaStateChanged)
        assert [(o.data.replica, o.data.model, o.data.version, o.data.state, o.data.signal) for o in outs] == [
            (job_id, "tiny-chat", "v7", ReplicaState.UNHEALTHY, "recovery")
        ]
        timeline = await sequenced(client, job_id)
        released = next(s for s, e in timeline if isinstance(e, ResourcesReleased) and e.attempt == 1)
        out_of_rotation = next(s for s, e in timeline if isinstance(e, ReplicaStateChanged))
        retry, request = next((s, e) for s, e in timeline if isinstance(e, RetryRequested))
        assert out_of_rotation < retry
        assert released < retry
        # The shipped inference policy retries with no backoff: the replacement keeps off the failed node
        # because the request names it, not because the cordon happened to reach the scheduler first.
        assert request.data.avoid_nodes == (node,)
        assert [e.data.avoid_nodes for e in await events_of(client, job_id, AttemptRequested)] == [(node,)]
        # The replacement is the same job (same spec, so the same model version), as its next attempt.
        assert [e.attempt for e in await events_of(client, job_id, AttemptRequested)] == [2]


# --- evaluation ----------------------------------------------------------------------------------


async def test_a_preempted_evaluation_is_rebuilt_from_the_start_ignoring_its_checkpoints(
    own_urls: ServerUrls, tmp_path: Path, unique: str
) -> None:
    job_id = f"eval-{unique}"
    eval_spec = JobSpec(name="eval", workload_class=WorkloadClass.EVALUATION, workers=2, gpus_per_worker=4)
    async with stack(own_urls, policy(), "scheduler", "lifecycle", "telemetry") as conns:
        client = LanesClient(conns.nc, "tests")
        await register_nodes(conns, client, NODES)
        await submit(client, job_id, eval_spec)
        placed = (await wait_for(client, job_id, JobPlaced, attempt=1))[0]
        run = ScriptedLauncher(client, placed)
        await run.start()
        await run.steps([10, 20, 30])
        await run.checkpoint(write_checkpoint(tmp_path, 20))
        await _evidence(
            client,
            PlatformEvidence,
            run.node_of(0),
            category=EvidenceCategory.PREEMPTION,
            summary="preempted by a higher-priority job",
        )
        await run.exit(0, exit_code=None, signal=signal.SIGTERM)
        await run.exit(1, exit_code=None, signal=signal.SIGTERM)

        requested = (await wait_for(client, job_id, AttemptRequested, attempt=2))[0]
        assert requested.data.resume_step == 0  # rebuilt from the start, though a checkpoint at 20 exists
        decided = (await events_of(client, job_id, RecoveryDecided))[0].data
        assert (decided.action, decided.first_error) == (RecoveryAction.REBUILD, "platform/preemption")
        assert decided.checkpoint is None
        assert decided.refused == ()
        assert decided.cordon == ()
        await wait_for(client, job_id, JobPlaced, attempt=2)


# --- the manual path -----------------------------------------------------------------------------


async def test_a_python_exception_waits_for_its_owner_escalates_once_past_the_deadline_and_the_owner_approves(
    own_urls: ServerUrls, tmp_path: Path, unique: str
) -> None:
    job_id = f"bug-{unique}"
    short_deadline = policy(manual_deadline_s=0.5)
    async with stack(own_urls, short_deadline, "scheduler", "lifecycle", "telemetry") as conns:
        # A second recovery process's timers on the same database: the escalation must still fire once.
        other = RecoveryTimers(conns.nc, conns.pool, Recovery(lambda: short_deadline), tick_s=0.05)
        stop = asyncio.Event()
        other_task = asyncio.create_task(other.run(stop))
        client = LanesClient(conns.nc, "tests")
        await register_nodes(conns, client, NODES)
        await submit(client, job_id, spec())
        placed = (await wait_for(client, job_id, JobPlaced, attempt=1))[0]
        run = ScriptedLauncher(client, placed)
        await run.start()
        await run.steps([50, 100])
        await run.checkpoint(write_checkpoint(tmp_path, 100))
        await run.steps([150])
        await run.output(
            0, ProcessEvidence, category=EvidenceCategory.PYTHON_EXCEPTION,
            summary="KeyError: 'labels'", error_type="KeyError",
            lines=("Traceback (most recent call last):", "KeyError: 'labels'"),
        )  # fmt: skip
        await run.exit(0, exit_code=1)
        await run.exit(1, exit_code=None, signal=signal.SIGTERM)

        held = (await wait_for(client, job_id, HoldRequested))[0]
        assert held.data.owner == "ada"
        await wait_for(client, job_id, JobStateChanged, data__to_state=JobState.AWAITING_MANUAL)
        decided = (await events_of(client, job_id, RecoveryDecided))[0]
        assert decided.data.action is RecoveryAction.MANUAL
        assert (decided.data.first_error, decided.data.owner, decided.data.owner_lane) == (
            "algorithm/python_exception", "ada", Lane.ALGORITHM,
        )  # fmt: skip
        assert decided.data.deadline is not None
        assert decided.data.finding_id == (await events_of(client, job_id, JobFinding))[-1].id
        assert await events_of(client, job_id, RetryRequested) == []

        escalated = (await wait_for(client, job_id, RecoveryEscalated))[0]
        assert (escalated.data.decision_id, escalated.data.owner) == (decided.id, "ada")

        async def timers_settled() -> bool:
            row = await conns.pool.fetchrow("SELECT next_due_at FROM recovery_jobs WHERE job_id = $1", job_id)
            return row is not None and row["next_due_at"] is None

        await eventually(timers_settled, what="no timer left for the job")
        stop.set()
        await other_task
        assert len(await events_of(client, job_id, RecoveryEscalated)) == 1

        approved = await run_lanes_async(
            own_urls, "recover", job_id, "--approve", "--reason", "fixed the labels", "--by", "ada"
        )
        assert approved.returncode == 0, approved.stderr
        resumed = (await wait_for(client, job_id, ResumeRequested))[0]
        assert (resumed.data.resume_step, resumed.data.requested_by) == (100, "ada")
        requested = (await wait_for(client, job_id, AttemptRequested, attempt=2))[0]
        assert requested.data.resume_step == 100
        by_owner = (await wait_for(client, job_id, RecoveryDecided, 2))[1].data
        assert (by_owner.manual_action, by_owner.requested_by, by_owner.action) == (
            ManualAction.APPROVE, "ada", RecoveryAction.RESUME,
        )  # fmt: skip
        assert "fixed the labels" in by_owner.reason

        again = await run_lanes_async(own_urls, "recover", job_id, "--abandon", "--reason", "twice", "--by", "ada")
        assert again.returncode == 0
        refused = (await wait_for(client, job_id, TransitionRejected, source="lanes/recovery"))[0]
        assert "no manual recovery decision is pending" in refused.data.reason


@pytest.mark.slow
async def test_lanes_recover_rollback_resumes_from_the_checkpoint_before_the_last_and_abandon_ends_the_job(
    own_urls: ServerUrls, tmp_path: Path, unique: str
) -> None:
    async with stack(own_urls, policy(), "lifecycle") as conns:
        client = LanesClient(conns.nc, "tests")
        rolled, abandoned = f"roll-{unique}", f"drop-{unique}"
        for job_id in (rolled, abandoned):
            await _fail_with(client, job_id, tmp_path, Lane.ALGORITHM, "nan_loss", checkpoints=(100, 200))
            await wait_for(client, job_id, JobStateChanged, data__to_state=JobState.AWAITING_MANUAL)

        usage = await run_lanes_async(own_urls, "recover", rolled, "--approve", "--rollback", "--reason", "x")
        assert usage.returncode == 2
        assert (await run_lanes_async(own_urls, "recover", rolled, "--approve")).returncode == 2  # no reason
        assert (
            await run_lanes_async(own_urls, "recover", f"none-{unique}", "--approve", "--reason", "x")
        ).returncode == 3

        rolled_back = await run_lanes_async(
            own_urls, "recover", rolled, "--rollback", "--reason", "200 diverged", "--by", "ada"
        )
        assert rolled_back.returncode == 0, rolled_back.stderr
        resumed = (await wait_for(client, rolled, ResumeRequested))[0]
        assert resumed.data.resume_step == 100
        decision = (await wait_for(client, rolled, RecoveryDecided, 2))[1].data
        assert (decision.manual_action, decision.requested_by, decision.resume_step) == (
            ManualAction.ROLLBACK,
            "ada",
            100,
        )

        dropped = await run_lanes_async(
            own_urls, "recover", abandoned, "--abandon", "--reason", "superseded", "--by", "bob"
        )
        assert dropped.returncode == 0, dropped.stderr
        cancel = (await wait_for(client, abandoned, CancelRequested))[0]
        assert cancel.data.requested_by == "bob"
        ended = (await wait_for(client, abandoned, JobStateChanged, data__to_state=JobState.CANCELLED))[0]
        assert ended.data.from_state is JobState.AWAITING_MANUAL
        decision = (await wait_for(client, abandoned, RecoveryDecided, 2))[1].data
        assert (decision.action, decision.requested_by, decision.reason) == (
            RecoveryAction.ABANDON, "bob", "abandoned by bob: superseded",
        )  # fmt: skip
        assert await events_of(client, abandoned, RetryRequested) == []


async def test_when_every_checkpoint_is_refused_the_job_waits_for_the_platform_owner_instead_of_resuming(
    own_urls: ServerUrls, tmp_path: Path, unique: str
) -> None:
    job_id = f"mismatch-{unique}"
    async with stack(own_urls, policy(), "lifecycle") as conns:
        client = LanesClient(conns.nc, "tests")
        await _fail_with(
            client, job_id, tmp_path, Lane.HOST, "gpu_xid", checkpoints=(100, 200),
            versions={"image": "registry.local/train:0"},
        )  # fmt: skip
        decided = (await wait_for(client, job_id, RecoveryDecided))[0].data
        assert decided.action is RecoveryAction.MANUAL
        assert (decided.owner, decided.owner_lane) == ("pat", Lane.PLATFORM)
        assert [(r.checkpoint.step, r.field, r.found) for r in decided.refused] == [
            (200, "image", "registry.local/train:0"),
            (100, "image", "registry.local/train:0"),
        ]
        held = (await wait_for(client, job_id, HoldRequested))[0]
        assert held.data.owner == "pat"
        await wait_for(client, job_id, JobStateChanged, data__to_state=JobState.AWAITING_MANUAL)
        assert await node_events(client, "n-2") == []  # no cordon: nothing automatic happens
        assert await events_of(client, job_id, RetryRequested) == []


async def test_a_crash_loop_stops_automatic_recovery_after_the_configured_count(
    own_urls: ServerUrls, tmp_path: Path, unique: str
) -> None:
    job_id = f"loop-{unique}"
    loops_at_two = policy(crash_loop_count=2, backoff={"base_s": 0})
    async with stack(own_urls, loops_at_two, "lifecycle") as conns:
        client = LanesClient(conns.nc, "tests")
        # Preemption does not cordon: the same error on the same node again is the loop (every attempt is
        # placed on n-1 and n-2 here, as a scheduler short of nodes would do).
        await _fail_with(client, job_id, tmp_path, Lane.PLATFORM, "preemption", checkpoints=(100,), node="n-1")
        await wait_for(client, job_id, AttemptRequested, attempt=2)
        await _fail_with(client, job_id, tmp_path, Lane.PLATFORM, "preemption", attempt=2, node="n-1")
        decisions = await wait_for(client, job_id, RecoveryDecided, 2)
        assert [d.data.action for d in decisions] == [RecoveryAction.RESUME, RecoveryAction.MANUAL]
        assert "crash loop: platform/preemption on n-1 2 times (limit 2)" in decisions[1].data.reason
        await wait_for(client, job_id, JobStateChanged, data__to_state=JobState.AWAITING_MANUAL)
        assert len(await events_of(client, job_id, RetryRequested)) == 1
        assert [e.attempt for e in await events_of(client, job_id, AttemptRequested)] == [2]


async def test_a_failed_attempt_with_no_finding_is_decided_after_the_grace_period(
    own_urls: ServerUrls, tmp_path: Path, unique: str
) -> None:
    job_id = f"silent-{unique}"
    async with stack(own_urls, policy(finding_grace_s=0.3), "lifecycle") as conns:
        client = LanesClient(conns.nc, "tests")
        await _fail_with(client, job_id, tmp_path, None, "", checkpoints=(100,))
        decided = (await wait_for(client, job_id, RecoveryDecided))[0].data
        assert (decided.first_error, decided.action) == ("platform/unknown", RecoveryAction.MANUAL)
        assert decided.finding_version is None
        await wait_for(client, job_id, JobStateChanged, data__to_state=JobState.AWAITING_MANUAL)
        late = FindingCause(category="oom_kill", lane=Lane.HOST, node="n-2")
        data = JobFindingData(version=1, first_error=late, stage="steady_state", confidence=0.9)
        await client.publish(JobFinding(source="tests", jobid=job_id, attempt=1, lane=Lane.HOST, data=data))

        async def recorded() -> bool:
            known = await conns.pool.fetchval("SELECT knowledge FROM recovery_jobs WHERE job_id = $1", job_id)
            return '"findings_after_decision":[1]' in str(known).replace(" ", "")

        await eventually(recorded, what="the late finding recorded")
        assert len(await events_of(client, job_id, RecoveryDecided)) == 1  # never decided twice for an attempt


async def test_a_checkpoint_that_cannot_be_hashed_never_delays_another_jobs_decision_and_its_own_says_unverified(
    own_urls: ServerUrls, tmp_path: Path, unique: str
) -> None:
    hog, canary = f"hog-{unique}", f"canary-{unique}"
    # A user's job names checkpoints recovery must not trust and must not hang on: a terabyte of holes (a
    # regular file whose hashing outlasts the policy's time limit) and /dev/zero (endless, not a file).
    sparse = tmp_path / "step-100.pt"
    with sparse.open("wb") as handle:
        handle.truncate(1 << 40)
    fake = "sha256:" + "ab" * 32
    hostile = (Checkpoint(100, sparse, fake), Checkpoint(200, Path("/dev/zero"), fake))
    async with stack(own_urls, policy(digest_timeout_s=15), "lifecycle") as conns:
        client = LanesClient(conns.nc, "tests")
        await _fail_with(client, hog, tmp_path, Lane.HOST, "gpu_xid", recorded=hostile)
        started = time.monotonic()
        await _fail_with(client, canary, tmp_path, Lane.HOST, "gpu_xid", checkpoints=(100,))
        (decided,) = [e.data for e in await wait_for(client, canary, RecoveryDecided)]
        print(f"canary: failed and decided in {time.monotonic() - started:.2f} s beside the hog's digest")  # noqa: T201
        assert (decided.action, decided.checkpoint and decided.checkpoint.step) == (RecoveryAction.RESUME, 100)
        # Decided while the hog's first digest still runs: the hog has no decision until its time limit.
        assert await events_of(client, hog, RecoveryDecided) == []

        (hogs,) = [e.data for e in await wait_for(client, hog, RecoveryDecided)]
        assert hogs.action is RecoveryAction.MANUAL
        assert {(r.checkpoint.step, r.found) for r in hogs.refused} == {
            (200, "unverified: /dev/zero is not a regular file"),
            (100, "unverified: not hashed within the digest time limit of 15 s"),
        }
        assert "unverified" in hogs.reason


async def _fail_with(  # noqa: PLR0917 - a failure story's parameters, named at each call
    client: LanesClient,
    job_id: str,
    tmp_path: Path,
    lane: Lane | None,
    category: str,
    checkpoints: tuple[int, ...] = (),
    attempt: int = 1,
    node: str = "n-2",
    versions: dict[str, str] | None = None,
    recorded: tuple[Checkpoint, ...] = (),
) -> None:
    """Run one attempt without a scheduler: placed on n-1 and n-2, checkpoints, a finding, a failure, a release.

    `checkpoints` are written as real files; `recorded` are records published as they are (any path).
    """
    if attempt == 1:
        await submit(client, job_id, spec())
    assignments = (RankAssignment(rank=0, node="n-1", gpus=(0,)), RankAssignment(rank=1, node="n-2", gpus=(0,)))
    await client.publish(
        JobPlaced(source="tests", jobid=job_id, attempt=attempt, data=JobPlacedData(assignments=assignments))
    )
    placed = (await wait_for(client, job_id, JobPlaced, attempt=attempt))[0]
    run = ScriptedLauncher(client, placed)
    await run.start()
    for step in checkpoints:
        await run.steps([step])
        directory = tmp_path / job_id / str(attempt)
        directory.mkdir(parents=True, exist_ok=True)
        await run.checkpoint(write_checkpoint(directory, step), **(versions or {}))
    for saved in recorded:
        await run.steps([saved.step])
        await run.checkpoint(saved, **(versions or {}))
    await run.steps([max((*checkpoints, *(saved.step for saved in recorded)), default=0) + 30])
    if lane is not None:
        cause = FindingCause(category=category, lane=lane, node=node, summary=f"{category} on {node}")
        finding = JobFindingData(version=1, first_error=cause, stage="steady_state", confidence=0.9, settled=True)
        await client.publish(JobFinding(source="tests", jobid=job_id, attempt=attempt, lane=lane, data=finding))
    await run.exit(1, exit_code=1 if lane is Lane.ALGORITHM else None, signal=None if lane is Lane.ALGORITHM else 9)
    await run.exit(0, exit_code=None, signal=signal.SIGTERM)
    await wait_for(client, job_id, JobStateChanged, data__to_state=JobState.FAILED, attempt=attempt)
    released = ResourcesReleasedData(nodes=("n-1", "n-2"), gpus=2)
    await client.publish(ResourcesReleased(source="tests", jobid=job_id, attempt=attempt, data=released))


# --- evidence with a time bound, and a cordon budget ---------------------------------------------

_SERVER_TRACEBACK = (
    "ERROR:    Exception in ASGI application",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/site-packages/starlette/responses.py", line 264, in __call__',
    "    await wrap(partial(self.stream_response, send))",
    "ConnectionResetError: [Errno 104] Connection reset by peer",
)


async def test_an_exception_sixteen_minutes_before_the_agent_lost_the_replica_is_not_its_first_error(
    own_urls: ServerUrls, unique: str
) -> None:
    job_id = f"serve-{unique}"
    async with stack(own_urls, policy(), "scheduler", "lifecycle", "telemetry") as conns:
        client = LanesClient(conns.nc, "tests")
        replica = await _started_replica(conns, client, job_id)
        node = replica.node_of(0)
        keys: dict[str, Any] = {"source": f"agent/{node}", "jobid": job_id, "attempt": 1, "rank": 0, "node": node}
        # The server logged a harmless exception when the router was killed, sixteen minutes ago ...
        exception = EvidenceData(
            category=EvidenceCategory.PYTHON_EXCEPTION,
            summary="ConnectionResetError: [Errno 104] Connection reset by peer",
            error_type="ConnectionResetError",
            lines=_SERVER_TRACEBACK,
        )
        await client.publish(ProcessEvidence(data=exception, time=utc_now() - timedelta(minutes=16), **keys))
        # ... and kept serving until its node agent restarted now and lost it.
        lost = "the agent restarted while this rank (pid 1000) ran; nothing read its output, so it was killed"
        fault = EvidenceData(
            category=EvidenceCategory.AGENT_FAULT, summary=f"rank 0 was lost by its agent: {lost}", origin="agent"
        )
        await client.publish(PlatformEvidence(data=fault, **keys))
        exited = RankExitedData(exit_code=None, evidence=2, lost=lost)
        await client.publish(RankExited(data=exited, lane=Lane.PLATFORM, **keys))

        decided = (await wait_for(client, job_id, RecoveryDecided))[0]
        assert (decided.data.action, decided.data.first_error) == (
            RecoveryAction.REPLACE_REPLICA, "platform/agent_fault",
        )  # fmt: skip
        assert decided.data.settled
        assert decided.data.cordon == ()
        used = next(f for f in await events_of(client, job_id, JobFinding) if f.id == decided.data.finding_id)
        assert used.data.first_error is not None
        assert used.data.first_error.category == "agent_fault"
        assert not [g for g in used.data.consequences if g.category == "python_exception"]
        await wait_for(client, job_id, JobPlaced, attempt=2)


async def test_the_cordon_budget_holds_and_the_next_node_waits_for_a_person(own_urls: ServerUrls, unique: str) -> None:
    one_node = policy(cordon_budget=CordonBudget(max_nodes=1, window_s=3600))
    single = spec(workers=1)
    jobs = (f"first-{unique}", f"second-{unique}")
    async with stack(own_urls, one_node, "scheduler", "lifecycle", "telemetry") as conns:
        client = LanesClient(conns.nc, "tests")
        await register_nodes(conns, client, NODES)
        decided: list[RecoveryDecided] = []
        for job_id in jobs:
            await submit(client, job_id, single)
            placed = (await wait_for(client, job_id, JobPlaced, attempt=1))[0]
            run = ScriptedLauncher(client, placed)
            await run.start()
            await _evidence(
                client, HostEvidence, run.node_of(0), category=EvidenceCategory.GPU_XID,
                summary="Xid 79: GPU has fallen off the bus", xid=79,
            )  # fmt: skip
            await run.exit(0, exit_code=None, signal=signal.SIGBUS)
            decided.append((await wait_for(client, job_id, RecoveryDecided))[0])

        first, second = (d.data for d in decided)
        assert (first.action, first.first_error, len(first.cordon)) == (RecoveryAction.RESUME, "host/gpu_xid", 1)
        assert (second.action, second.first_error, second.cordon) == (RecoveryAction.MANUAL, "host/gpu_xid", ())
        assert "cordon budget spent: recovery cordoned 1 node(s) within the last 3600 s" in second.reason
        assert second.owner == "hal"
        held = (await wait_for(client, jobs[1], HoldRequested))[0]
        assert held.data.owner == "hal"
        cordoned = [
            e
            for node in NODES
            for e in await node_events(client, node)
            if isinstance(e, NodeStateChanged) and e.data.state is NodeState.CORDONED
        ]
        assert [e.node for e in cordoned] == list(first.cordon)
