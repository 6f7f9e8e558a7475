"""The replay check over drills: `lanes drill` runs recorded, then replayed through recovery's own code.

A kill drill (a host fault: resumed from the checkpoint elsewhere) and an exception drill (an algorithm fault:
left to the model's owner) on a real 4-rank torch.distributed job, with scheduler, lifecycle, telemetry and
recovery running against the test's own NATS. The job stream is exported as `lanes demo --export` exports it,
and `lanes whatif recovery`'s replay under the shipped policy must reproduce every decision recorded.

With LANES_RECORD_DRILLS=PATH the exported log is kept at PATH: that is how tests/data/whatif/drills.ndjson was
recorded (re-record it only as a reviewed act, like the demo's log).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.cli import local_stack, run_lanes_async
from support.optional import TORCH, require
from support.recovery import register_nodes, spec
from support.waiting import eventually

from lanes_agent.launcher import LocalLauncher
from lanes_cli.demo import export_jobs
from lanes_cli.import_cli import read_events
from lanes_cli.timeline import job_timeline
from lanes_contract.client import LanesClient
from lanes_contract.events import CheckpointSaved, JobSubmitted, JobSubmittedData, RecoveryAction
from lanes_recovery.views import default_policy, replay_recovery
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]

require(TORCH)

NODES = [f"drill-{i}" for i in range(1, 6)]
DRILLED_RANK = 2
RECORD_ENV = "LANES_RECORD_DRILLS"


@pytest.fixture
async def stack(own_urls: ServerUrls, tmp_path: Path) -> AsyncIterator[Connections]:
    """The four services and one agent for five nodes of four GPUs (a rank fills a node; one left to resume on)."""
    async with local_stack(own_urls, ["scheduler", "lifecycle", "telemetry", "recovery"], nodes=False) as conns:
        stop = asyncio.Event()
        agent = LocalLauncher(
            conns.nc, frozenset(NODES), durable="agent-whatif-drills", stop_grace_s=2.0, state_dir=tmp_path / "ledger"
        )
        running = asyncio.create_task(agent.run(stop))
        try:
            await register_nodes(conns, LanesClient(conns.nc, "tests"), NODES)
            yield conns
        finally:
            stop.set()
            await running


async def _checkpointed(conns: Connections, job_id: str) -> bool:
    timeline = await job_timeline(conns.nc.jetstream(), job_id)
    return any(isinstance(entry.event, CheckpointSaved) for entry in timeline)


async def _drill(conns: Connections, urls: ServerUrls, tmp_path: Path, kind: str) -> dict[str, object]:
    job_id = f"whatif-drill-{kind}"
    command = (sys.executable, "-m", "lanes_agent.drill_workload", "--step-s", "0.05", "--timeout-s", "15")
    job = spec("drill", workers=4, command=command, checkpoint_location=str(tmp_path / f"checkpoints-{kind}"))
    await LanesClient(conns.nc, "tests").publish(
        JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=job))
    )
    await eventually(lambda: _checkpointed(conns, job_id), timeout_s=240, what=f"{job_id}'s first checkpoint")
    ran = await run_lanes_async(
        urls, "drill", job_id, "--kind", kind, "--rank", str(DRILLED_RANK), "--timeout", "300", "--json"
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    (report,) = json.loads(ran.stdout)["drills"]
    assert report["named_right"], report
    result: dict[str, object] = report
    return result


async def test_the_drills_recorded_log_replays_to_every_recorded_decision(
    stack: Connections, own_urls: ServerUrls, tmp_path: Path
) -> None:
    kill = await _drill(stack, own_urls, tmp_path, "kill")
    assert kill["decision"] == "resume"
    # Its resumed attempt holds the four nodes left beside the cordoned one: stop it, to make room for the next.
    cancelled = await run_lanes_async(own_urls, "cancel", "whatif-drill-kill")
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    exception = await _drill(stack, own_urls, tmp_path, "exception")
    assert exception["decision"] == "manual"

    log = tmp_path / "drills.ndjson"
    assert await export_jobs(stack.nc.jetstream(), log) > 0
    if target := os.environ.get(RECORD_ENV):
        shutil.copyfile(log, target)
    result = await replay_recovery(read_events(log), default_policy())
    assert result.diff == ()
    assert sorted(d.data.action for d in result.recorded) == sorted([RecoveryAction.RESUME, RecoveryAction.MANUAL])
    assert [d.id for d in result.new] == [d.id for d in result.recorded]
