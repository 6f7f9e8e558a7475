"""`lanes run -- <command>` as a process, against real NATS, PostgreSQL and the services.

The wrapped command's exit status and output pass through unchanged; with NATS down the events wait in
the outbox and `lanes import` delivers them once (importing again stores nothing); the live finding is the
one `lanes analyze` elects from the same output.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.cli import LANES, local_stack, run_lanes_async
from support.observe import OBSERVE_SERVICES, closed_nats_url, in_state, job_view, poc_verdicts, timeline_events
from support.waiting import eventually

from lanes_contract.events import JobFinding, JobSubmitted, RankExited, RankStarted, RecoveryDecided
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers

_FAILING = (
    "import sys\n"
    "print('step 1', flush=True)\n"
    "raise RuntimeError('CUDA error: an illegal memory access was encountered')\n"
)


@pytest.fixture
async def stack(own_urls: ServerUrls) -> AsyncIterator[Connections]:
    async with local_stack(own_urls, OBSERVE_SERVICES, nodes=False) as conns:
        yield conns


async def _lanes_run(nats_url: str, *args: str) -> tuple[int, str, str]:
    env = os.environ | {"NATS_URL": nats_url, "LANES_LOG_FORMAT": "json"}
    proc = await asyncio.create_subprocess_exec(
        LANES, "run", *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_nats_down_the_exit_code_is_unchanged_and_import_delivers_each_event_once(
    stack: Connections, own_urls: ServerUrls, unique: str, tmp_path: Path
) -> None:
    job_id = f"offline-{unique}"
    outbox = tmp_path / "outbox.ndjson"
    script = "import sys; print('hello from the job', flush=True); sys.exit(3)"
    code, out, err = await _lanes_run(
        closed_nats_url(),
        "--job",
        job_id,
        "--node",
        "n-test",
        "--outbox",
        str(outbox),
        "--",
        sys.executable,
        "-c",
        script,
    )
    assert code == 3
    assert out == "hello from the job\n"
    assert f"lanes import {outbox}" in err
    waiting = len(outbox.read_bytes().splitlines())
    assert waiting >= 5  # submitted, placed, started, exited, released

    first = await run_lanes_async(own_urls, "import", str(outbox))
    assert json.loads(first.stdout) == {"stored": waiting, "already_present": 0}
    again = await run_lanes_async(own_urls, "import", str(outbox))
    assert json.loads(again.stdout) == {"stored": 0, "already_present": waiting}

    await eventually(lambda: in_state(own_urls, job_id, "released"), what="the imported job released", timeout_s=60)
    view = await job_view(own_urls, job_id)
    assert view is not None
    assert view["spec"]["managed_by"] == "lanes-run"
    (attempt,) = view["attempts"]
    assert (attempt["exit_cause"] or attempt["cause"]) == "user_code_error"  # as the exits said (before any finding)
    assert view["attempts"][0]["ranks"]["0"]["exit_code"] == 3
    events = await timeline_events(stack, job_id)
    assert sum(isinstance(e, JobSubmitted) for e in events) == 1
    assert sum(isinstance(e, RankExited) for e in events) == 1


async def test_live_run_reports_ranks_and_its_finding_is_the_one_lanes_analyze_elects(
    stack: Connections, own_urls: ServerUrls, unique: str, tmp_path: Path
) -> None:
    job_id = f"live-{unique}"
    outbox = tmp_path / "outbox.ndjson"
    code, _, err = await _lanes_run(
        own_urls.nats_url,
        "--job", job_id, "--node", "n-test", "--outbox", str(outbox), "--", sys.executable, "-c", _FAILING,
    )  # fmt: skip
    assert code == 1
    assert "RuntimeError: CUDA error" in err
    assert not outbox.exists()  # everything was published while the command ran

    await eventually(lambda: in_state(own_urls, job_id, "released"), what="the job released", timeout_s=60)
    events = await timeline_events(stack, job_id)
    (started,) = [e for e in events if isinstance(e, RankStarted)]
    assert (started.rank, started.node) == (0, "n-test")
    assert started.data.pid is not None

    async def found() -> bool:
        return any(isinstance(e, JobFinding) for e in await timeline_events(stack, job_id))

    await eventually(found, what="a finding", timeout_s=60)
    live = [e for e in await timeline_events(stack, job_id) if isinstance(e, JobFinding)][-1].data

    logs = tmp_path / "logs" / "n-test"
    logs.mkdir(parents=True)
    (logs / "rank0.log").write_text(err)
    offline = json.loads((await run_lanes_async(None, "analyze", "--json", str(tmp_path / "logs"))).stdout)
    assert live.first_error is not None
    expected = offline["first_error"]
    assert (live.first_error.category, live.first_error.lane.value, live.first_error.node, live.first_error.rank) == (
        expected["category"],
        expected["lane"],
        expected["node"],
        expected["rank"],
    )
    assert live.first_error.summary == expected["summary"]
    assert live.stage == offline["stage"]

    assert (await poc_verdicts(own_urls, job_id))["communication observability"] == "passed"

    # Observe mode: the scheduler never placed (nor rejected) the job; recovery decided but acted on nothing.
    async def decided() -> bool:
        return any(isinstance(e, RecoveryDecided) for e in await timeline_events(stack, job_id))

    await eventually(decided, what="recovery's decision", timeout_s=60)
    events = await timeline_events(stack, job_id)
    assert not [e for e in events if e.source == "lanes/scheduler"]
    from_recovery = {type(e).__name__ for e in events if e.source == "lanes/recovery"}
    assert from_recovery <= {"RecoveryDecided", "RecoveryEscalated"}
    view = await job_view(own_urls, job_id)
    assert view is not None
    assert view["state"] == "released"
    assert len(view["attempts"]) == 1
