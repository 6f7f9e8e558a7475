"""An incident bundle re-played into an empty server gives the same timeline, bundle and verdicts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from support.cli import Ran, run_lanes

from lanes_contract.client import LanesClient
from lanes_contract.events import (
    JobPlaced,
    JobPlacedData,
    JobSubmitted,
    JobSubmittedData,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
)
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import provision_streams
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = pytest.mark.real_servers


def _lanes(nats_url: str, *args: str, extra_env: dict[str, str] | None = None) -> Ran:
    env: dict[str, str | None] = {"NATS_URL": nats_url, "DATABASE_URL": None, "REDIS_URL": None}
    return run_lanes(None, *args, env=env | (extra_env or {}))


async def _failing_job(nats_url: str, job_id: str) -> None:
    async with await LanesClient.connect(nats_url, source="tests") as lanes:
        await provision_streams(lanes.js)
        submitted = JobSubmitted(
            source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=JobSpec(name="t", workers=2))
        )
        await lanes.publish(submitted)
        assignments = (RankAssignment(rank=0, node="n1", gpus=(0,)), RankAssignment(rank=1, node="n2", gpus=(0,)))
        await lanes.publish(
            JobPlaced(source="tests", jobid=job_id, attempt=1, data=JobPlacedData(assignments=assignments))
        )
        for rank, node in ((0, "n1"), (1, "n2")):
            started = RankStartedData(pid=100 + rank)
            await lanes.publish(
                RankStarted(source=f"agent/{node}", jobid=job_id, attempt=1, node=node, rank=rank, data=started)
            )
        killed = RankExitedData(exit_code=None, signal=9)
        await lanes.publish(RankExited(source="agent/n2", jobid=job_id, attempt=1, node="n2", rank=1, data=killed))


@pytest.mark.slow
async def test_a_bundle_replays_into_an_empty_server_with_the_same_findings(
    servers: ServerUrls, unique: str, tmp_path: Path
) -> None:
    job_id = f"incident-{unique}"
    await _failing_job(servers.nats_url, job_id)
    written = _lanes(servers.nats_url, "incident", job_id, "--out", str(tmp_path / "bundle"), "--json")
    assert written.returncode == 0, written.stderr
    original = json.loads(written.stdout)
    assert original["summary"]["failed"] is True
    assert original["summary"]["first_error"]["rank"] == 1
    assert original["evidence"]["host"]  # the rank events are host-lane evidence
    verdicts = json.loads(_lanes(servers.nats_url, "poc", "--job", job_id, "--json").stdout)
    events = tmp_path / "bundle" / "events.ndjson"
    assert len(events.read_text().splitlines()) == 5

    with EmbeddedNats() as empty:
        imported = _lanes(empty.url, "import", str(events))
        assert imported.returncode == 0, imported.stderr
        assert json.loads(imported.stdout) == {"stored": 5, "already_present": 0}
        again = json.loads(_lanes(empty.url, "import", str(events)).stdout)
        assert again == {"stored": 0, "already_present": 5}  # same ids: stored once
        replayed = json.loads(_lanes(empty.url, "incident", job_id, "--json").stdout)
        replayed_verdicts = json.loads(_lanes(empty.url, "poc", "--job", job_id, "--json").stdout)
    assert replayed == original
    assert replayed_verdicts == verdicts


def test_a_bad_line_in_an_import_file_is_named(tmp_path: Path, servers: ServerUrls) -> None:
    bad = tmp_path / "bad.ndjson"
    bad.write_text('{"specversion":"1.0","type":"io.lanes.job.submitted.v1"}\n')
    result = _lanes(servers.nats_url, "import", str(bad))
    assert result.returncode == 2
    assert f"{bad}:1:" in result.stderr


@pytest.mark.slow
async def test_the_demos_failing_job_bundle_replays_with_the_same_finding_and_verdicts(
    servers: ServerUrls, database_url: str, tmp_path: Path
) -> None:
    with EmbeddedNats() as live, EmbeddedNats() as empty:
        env = {"DATABASE_URL": database_url, "REDIS_URL": servers.redis_url}
        demo = await asyncio.to_thread(_lanes, live.url, "demo", "--json", extra_env=env)
        assert demo.returncode == 0, demo.stderr[-3000:]
        oom_job = next(
            job["job_id"] for job in json.loads(demo.stdout)["jobs"] if job["job_id"].startswith("demo-oom-")
        )
        written = _lanes(live.url, "incident", oom_job, "--out", str(tmp_path / "bundle"), "--json")
        assert written.returncode == 0, written.stderr
        original = json.loads(written.stdout)
        assert original["summary"]["first_error"]["category"] == "oom_kill"
        assert original["summary"]["lane"] == "host"
        verdicts = json.loads(_lanes(live.url, "poc", "--job", oom_job, "--json").stdout)

        imported = _lanes(empty.url, "import", str(tmp_path / "bundle" / "events.ndjson"))
        assert imported.returncode == 0, imported.stderr
        replayed = json.loads(_lanes(empty.url, "incident", oom_job, "--json").stdout)
        replayed_verdicts = json.loads(_lanes(empty.url, "poc", "--job", oom_job, "--json").stdout)
    assert replayed == original
    assert replayed_verdicts == verdicts
