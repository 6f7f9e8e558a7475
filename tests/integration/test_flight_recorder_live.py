"""Flight Recorder dumps on the live path: the node agent turns each rank's recorder on, collects the dumps the
ranks write, and telemetry reads them with the rest of the evidence.

A real 3-rank gloo job (the drill workload) on the demo's nodes; rank 1 is hung (SIGSTOP, never resumed). Its
peers' all-reduce times out, each dumps its buffer and exits; the hung rank never can. The finding carries the
peers' last collectives and names rank 1's dump as the missing piece of evidence, with the collective it would
settle.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.cli import local_stack, run_lanes_async
from support.optional import TORCH, require
from support.recovery import spec
from support.waiting import eventually

from lanes_cli.timeline import job_timeline
from lanes_contract.client import LanesClient
from lanes_contract.events import (
    CheckpointSaved,
    DrillInjected,
    JobEvidence,
    JobFinding,
    JobSubmitted,
    JobSubmittedData,
)
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]

require(TORCH)

HUNG = 1


async def _checkpointed(conns: Connections, job_id: str) -> bool:
    return any(isinstance(e.event, CheckpointSaved) for e in await job_timeline(conns.nc.jetstream(), job_id))


async def test_the_hung_ranks_dump_is_named_missing_beside_its_peers_dumps(own_urls: ServerUrls, tmp_path: Path):
    job_id = "drill-flight-recorder"
    services = ["scheduler", "lifecycle", "telemetry", "recovery"]
    async with local_stack(own_urls, services, stop_grace_s=2.0) as conns:
        command = (sys.executable, "-m", "lanes_agent.drill_workload", "--step-s", "0.05", "--timeout-s", "10")
        job = spec("drill", workers=3, command=command, checkpoint_location=str(tmp_path / "checkpoints"))
        await LanesClient(conns.nc, "tests").publish(
            JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=job))
        )
        await eventually(lambda: _checkpointed(conns, job_id), timeout_s=180, what="the job's first checkpoint")
        ran = await run_lanes_async(
            own_urls, "drill", job_id, "--kind", "hang", "--rank", str(HUNG), "--timeout", "240", "--json"
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
        (report,) = json.loads(ran.stdout)["drills"]
        assert report["named_right"], report

        async def settled() -> bool:
            timeline = await job_timeline(conns.nc.jetstream(), job_id)
            return any(
                isinstance(e.event, JobFinding) and e.event.attempt == 1 and e.event.data.settled for e in timeline
            )

        await eventually(settled, timeout_s=120, what="attempt 1's settled finding")
        timeline = await job_timeline(conns.nc.jetstream(), job_id)

    findings = [e.event for e in timeline if isinstance(e.event, JobFinding) and e.event.attempt == 1]
    finding = max(findings, key=lambda f: f.data.version)

    # Every peer dumped: its last collective is on the timeline as its evidence.
    dumps = [
        e.event
        for e in timeline
        if isinstance(e.event, JobEvidence) and e.event.data.evidence.summary.startswith("Flight Recorder: ")
    ]
    dumped = {e.rank: e.data.evidence.summary for e in dumps}
    assert dumped, "no peer's dump was read"
    # Each dump is evidence from when it was written, after the hang: never before the fault it reports.
    (injected,) = [e.event for e in timeline if isinstance(e.event, DrillInjected)]
    assert all(e.time > injected.time for e in dumps), [(e.rank, e.time, injected.time) for e in dumps]
    assert HUNG not in dumped
    assert all("last entered collective" in summary for summary in dumped.values()), dumped
    # The hung rank's dump never came, and the finding says what it would have settled. (A peer stopped by the
    # teardown before it dumped would be named too: the absent dumps are exactly the ranks without one.)
    missing = [m for m in finding.data.missing_evidence if "Flight Recorder" in m.what]
    assert {m.rank for m in missing} == {0, 1, 2} - set(dumped), missing
    missing = [m for m in missing if m.rank == HUNG]
    assert missing[0].what.startswith(
        f"rank {HUNG}'s Flight Recorder dump is missing: it would settle whether rank {HUNG} entered collective "
    )
