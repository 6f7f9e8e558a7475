"""A node agent whose durable is deleted or re-filtered by someone else restores it, after the ack floor it keeps
in its state directory (an agent has no database), and runs every placement once (issue 34, item 1).

The launcher runs in this process against a NATS server of the test's own; the harm is done as the admin.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import pytest
from support.logs import json_logs
from support.stored_events import job_events_stored
from support.waiting import eventually

from lanes_agent.launcher import LocalLauncher
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.events import JobPlaced, JobPlacedData, JobSubmitted, JobSubmittedData, RankAssignment
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS
from lanes_runtime import upkeep
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = pytest.mark.real_servers
_NODE = "node-1"


async def _run_job(client: LanesClient, job_id: str) -> None:
    """Submit and place a one-rank job on `_NODE` that exits at once."""
    spec = JobSpec(name="kept", workers=1, command=(sys.executable, "-c", "pass"))
    await client.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
    assignments = (RankAssignment(rank=0, node=_NODE, gpus=(0,)),)
    await client.publish(
        JobPlaced(source="tests", jobid=job_id, attempt=1, data=JobPlacedData(assignments=assignments))
    )


async def _exited(client: LanesClient, job_id: str) -> bool:
    return _count(await job_events_stored(client.js, job_id), "rank_exited") > 0


@pytest.mark.parametrize("harm", ["deleted", "re-filtered"])
async def test_an_agent_restores_its_durable_after_its_floor_and_runs_each_placement_once(
    secured_nats: EmbeddedNats,
    tmp_path: Path,
    unique: str,
    *,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    harm: str,
) -> None:
    monkeypatch.setattr(upkeep, "CHECK_EVERY_S", 0.5)  # the same path as every three seconds, sooner
    nc = await connect_nats(secured_nats.url, name="tests")
    client = LanesClient(nc, "tests")
    durable = f"agent-kept-{unique}"
    stop = asyncio.Event()
    with json_logs(capsys) as logs:
        launcher = LocalLauncher(nc, frozenset({_NODE}), durable=durable, state_dir=tmp_path / "ranks", heartbeat_s=60)
        running = asyncio.create_task(launcher.run(stop))
        try:
            before, after = f"before-{unique}", f"after-{unique}"
            await _run_job(client, before)
            await eventually(lambda: _exited(client, before), timeout_s=60, what="the first job's rank to exit")

            floor_file = tmp_path / "ranks" / "floors" / f"{durable}.floor.json"

            async def floor_recorded() -> bool:
                return floor_file.exists() and json.loads(floor_file.read_text())["ack_floor"] > 0

            await eventually(floor_recorded, what="the agent's ack floor recorded in its state directory")
            if harm == "deleted":
                await nc.jetstream().delete_consumer(JOBS.name, durable)
            else:
                info = await nc.jetstream().consumer_info(JOBS.name, durable)
                bent = dataclasses.replace(
                    info.config, filter_subjects=["lanes.job.no-such-job.>"], filter_subject=None
                )
                await nc.jetstream().add_consumer(JOBS.name, config=bent)
            await _run_job(client, after)
            await eventually(lambda: _exited(client, after), timeout_s=60, what="the later job's rank to exit")
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    stored = {job: await job_events_stored(client.js, job) for job in (before, after)}
    await nc.close()
    for job, events in stored.items():
        assert [key for key, count in events.items() if count > 1] == [], job
        assert _count(events, "rank_started") == 1, job
    restored = [line for line in logs.about(durable) if line["event"] == "durable consumer restored"]
    assert [line["did"].split(" from ")[0] for line in restored] == ["recreated"]


def _count(events: dict[tuple[str, str], int], kind: str) -> int:
    return sum(count for (name, _), count in events.items() if name == kind)
