"""A slow rank that would cost more than a restart: recovery stops the attempt and resumes it elsewhere.

Real services (scheduler, lifecycle, telemetry, recovery) and a real node agent running three rank processes.
From step 40 rank 1 computes 40% longer and the others wait for it; the job means to take a million steps, so
the slowness would cost hours against a restart's five minutes. Telemetry names rank 1 and its node; recovery
decides `restart` with both figures, cordons that node, cancels the attempt, and asks for attempt 2 from the
verified checkpoint (step 30, a real file with its digest) away from the node.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from support.recovery import CONFIG, DATA, IMAGE, MODEL, events_of, policy, spec, stack, wait_for
from support.waiting import eventually

from lanes_agent.launcher import LocalLauncher
from lanes_cli.demo import DEMO_NODES, register_nodes
from lanes_contract.client import LanesClient
from lanes_contract.events import (
    Heartbeat,
    JobPlaced,
    JobSlowdown,
    JobStateChanged,
    JobSubmitted,
    JobSubmittedData,
    RecoveryAction,
    RecoveryDecided,
)
from lanes_contract.jobs import JobState
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers

SLOW_RANK = 1
_RANK = f"""
import hashlib, os, pathlib, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["LANES_ATTEMPT"])
if attempt > 1:  # the restarted attempt says where it resumed, and ends well
    print(f"lanes: step {{os.environ.get('LANES_RESUME_STEP', '0')}}", flush=True)
    sys.exit(0)
step = 0
while True:  # until the attempt is stopped
    step += 1
    slow = step >= 40
    compute = 0.03 * (1.4 if slow and rank == {SLOW_RANK} else 1.0)
    slowest = 0.03 * (1.4 if slow else 1.0)
    time.sleep(slowest + 0.005)
    print(f"lanes: step {{step}} compute_s={{compute:.4f}} wait_s={{slowest - compute + 0.005:.4f}}", flush=True)
    if rank == 0 and step == 30:
        path = pathlib.Path(sys.argv[1]) / "step-30.pt"
        path.write_bytes(b"weights at step 30" * 64)
        digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        print(f"lanes: checkpoint saved step=30 path={{path}} digest={{digest}} model_version={MODEL} "
              f"data_version={DATA} config_version={CONFIG} image={IMAGE}", flush=True)
"""


async def test_a_slow_rank_worth_a_restart_is_cordoned_and_the_job_resumes_elsewhere(
    own_urls: ServerUrls, tmp_path: Path
) -> None:
    job_id = "slow-restart"
    job = spec(
        "slow",
        workers=3,
        gpus_per_worker=4,
        steps=1_000_000,
        command=(sys.executable, "-c", _RANK, str(tmp_path)),
    )
    async with stack(own_urls, policy(finding_grace_s=5), "scheduler", "lifecycle", "telemetry") as conns:
        client = LanesClient(conns.nc, "tests")
        stop = asyncio.Event()
        agent = asyncio.create_task(LocalLauncher(conns.nc, frozenset(DEMO_NODES), stop_grace_s=2).run(stop))
        try:
            await register_nodes(client, DEMO_NODES)
            await client.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=job)))
            (slowdown,) = await wait_for(client, job_id, JobSlowdown, timeout_s=90)
            (decided,) = await wait_for(client, job_id, RecoveryDecided, timeout_s=60)

            async def succeeded() -> bool:
                changes = await events_of(client, job_id, JobStateChanged)
                return any(c.attempt == 2 and c.data.to_state is JobState.SUCCEEDED for c in changes)

            await eventually(succeeded, timeout_s=120, what="attempt 2 succeeded")
            first, second = await wait_for(client, job_id, JobPlaced, count=2)
            changes = await events_of(client, job_id, JobStateChanged)
            beats = [b for b in await events_of(client, job_id, Heartbeat) if b.attempt == 2]
        finally:
            stop.set()
            await agent

    slow_node = next(a.node for a in first.data.assignments if a.rank == SLOW_RANK)
    assert (slowdown.data.kind, slowdown.data.rank, slowdown.data.node) == ("compute_straggler", SLOW_RANK, slow_node)
    data = decided.data
    assert data.action is RecoveryAction.RESTART, data.reason
    assert "a restart" in data.reason
    assert data.cordon == (slow_node,)
    assert data.resume_step == 30
    assert slow_node not in {a.node for a in second.data.assignments}
    assert [b.data.step for b in beats] == [30, 30, 30]
    # Attempt 1 was stopped by recovery, not failed: cancelled, with recovery named as who asked and why.
    (cancelled,) = [c for c in changes if c.attempt == 1 and c.data.to_state is JobState.CANCELLED]
    assert "lanes/recovery" in cancelled.data.reason, cancelled.data.reason
