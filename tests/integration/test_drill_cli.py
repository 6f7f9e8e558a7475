"""`lanes drill` and `lanes agent` at their edges: what they refuse, and how they say it (a real NATS)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.cli import run_lanes_async

from lanes_contract.client import LanesClient
from lanes_contract.events import (
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    RankStarted,
    RankStartedData,
)
from lanes_contract.jobs import JobSpec, JobState
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers


async def test_a_drill_needs_a_job_and_a_kind_or_a_valid_plan(own_urls: ServerUrls, tmp_path: Path) -> None:
    ran = await run_lanes_async(own_urls, "drill", "some-job")
    assert ran.returncode == 2
    assert "give a job and --kind, or --plan" in ran.stderr
    plan = tmp_path / "drills.yaml"
    plan.write_text("drills:\n  - {job: j1, kind: meteor, rank: 0}\n")
    ran = await run_lanes_async(own_urls, "drill", "--plan", str(plan))
    assert ran.returncode == 2
    assert "drills.yaml: drills.0.kind: Input should be 'kill'" in ran.stderr  # one line, naming the field
    assert ran.stderr.count("\n") == 1
    ran = await run_lanes_async(own_urls, "drill", "job.>", "--kind", "kill")
    assert ran.returncode == 2  # a wildcard is no job id
    ran = await run_lanes_async(own_urls, "drill", "--plan", str(tmp_path / "missing.yaml"))
    assert ran.returncode == 2


async def test_a_drill_of_a_job_that_is_not_running_or_has_no_such_rank_injects_nothing(
    urls: ServerUrls, lanes: LanesClient, unique: str
) -> None:
    job_id = f"drill-target-{unique}"
    spec = JobSpec(name="t", workers=1, command=(sys.executable, "-c", "pass"))
    await lanes.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
    ran = await run_lanes_async(urls, "drill", job_id, "--kind", "kill")
    assert ran.returncode == 1
    assert "the job is not running (it is unknown)" in ran.stderr

    change = JobStateChangedData(
        from_state=JobState.STARTING, to_state=JobState.RUNNING, reason="all ranks ready", cause_type="tests"
    )
    await lanes.publish(JobStateChanged(source="lanes/lifecycle", jobid=job_id, attempt=1, data=change))
    # The rank's process is gone (a pid no process has): nothing to signal, and the drill says so.
    started = RankStarted(
        source="agent/n1", jobid=job_id, attempt=1, rank=0, node="n1", data=RankStartedData(pid=2**22 + 1)
    )
    await lanes.publish(started)
    ran = await run_lanes_async(urls, "drill", job_id, "--kind", "kill", "--rank", "3")
    assert ran.returncode == 1
    assert "the running attempt 1 has no rank 3" in ran.stderr
    ran = await run_lanes_async(urls, "drill", job_id, "--kind", "kill", "--rank", "0", "--timeout", "5")
    assert ran.returncode == 1
    assert "is not running on this host" in ran.stderr
    assert "drill_injected" not in str(await run_lanes_async(urls, "timeline", job_id, "--json"))


async def test_a_replica_drill_needs_an_inference_replica(urls: ServerUrls, lanes: LanesClient, unique: str) -> None:
    ran = await run_lanes_async(urls, "drill", f"nothing-{unique}", "--kind", "replica-kill")
    assert ran.returncode == 3
    assert f"unknown replica 'nothing-{unique}'" in ran.stderr
    job_id = f"train-{unique}"
    spec = JobSpec(name="t", workers=1, command=(sys.executable, "-c", "pass"))
    await lanes.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
    ran = await run_lanes_async(urls, "drill", job_id, "--kind", "replica-drain")
    assert ran.returncode == 1
    assert f"job {job_id} is not an inference replica (no serving spec)" in ran.stderr
    assert "drill_injected" not in str(await run_lanes_async(urls, "timeline", job_id, "--json"))


async def test_an_agent_refuses_a_node_name_that_is_not_a_token(own_urls: ServerUrls) -> None:
    ran = await run_lanes_async(own_urls, "agent", "--node", "node.*")
    assert ran.returncode == 2
    assert "invalid node name 'node.*'" in ran.stderr
    ran = await run_lanes_async(own_urls, "agent", "--node", "n1", env={"NATS_URL": None})
    assert ran.returncode == 2
    assert "NATS_URL is not set" in ran.stderr
