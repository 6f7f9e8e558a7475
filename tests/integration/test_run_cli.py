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

from lanes_contract.client import LanesClient
from lanes_contract.codec import MSG_ID_HEADER, decode_structured, encode
from lanes_contract.events import (
    Heartbeat,
    HeartbeatData,
    JobEvidence,
    JobFinding,
    JobSubmitted,
    RankExited,
    RankStarted,
    RecoveryDecided,
)
from lanes_contract.ids import dedupe_id
from lanes_contract.streams import JOBS
from lanes_observe import observed
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


async def _lanes_run(nats_url: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    env = os.environ | {"NATS_URL": nats_url, "LANES_LOG_FORMAT": "json"} | (env or {})
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


async def test_a_job_another_observer_registered_first_is_joined_not_refused(
    stack: Connections, own_urls: ServerUrls, unique: str, tmp_path: Path
) -> None:
    """The Slurm adapter and `lanes run` register one job under the same ids; whoever comes second joins it."""
    job_id = f"co-observed-{unique}"
    spec = observed.observed_spec("co-observed", workers=1, managed_by="lanes-run")
    async with await LanesClient.connect(own_urls.nats_url, source="lanes-slurm") as adapter:
        await adapter.publish(observed.submitted(job_id, spec, source="lanes-slurm"))
    outbox = tmp_path / "outbox.ndjson"
    code, _, err = await _lanes_run(
        own_urls.nats_url, "--job", job_id, "--node", "n-test", "--outbox", str(outbox), "--", sys.executable, "-c", ""
    )
    assert (code, outbox.exists()) == (0, False), err
    assert "not stored" not in err
    await eventually(lambda: in_state(own_urls, job_id, "released"), what="the job released", timeout_s=60)
    events = await timeline_events(stack, job_id)
    assert [e.source for e in events if isinstance(e, JobSubmitted)] == ["lanes-slurm"]
    assert sum(isinstance(e, RankExited) for e in events) == 1


async def test_an_event_whose_id_is_squatted_is_set_aside_and_the_rest_are_delivered(
    stack: Connections, own_urls: ServerUrls, unique: str, tmp_path: Path
) -> None:
    """Before: the conflict counted as "Lanes unreachable", and every event after it stayed in the outbox."""
    job_id = f"squatted-run-{unique}"
    squatted_id = observed.observed_id(job_id, 1, JobSubmitted)
    beat = encode(
        Heartbeat(source="agent/n-x", jobid=job_id, attempt=1, node="n-x", rank=0, data=HeartbeatData(step=1))
    )
    async with await LanesClient.connect(own_urls.nats_url, source="squatter") as squatter:
        headers = {
            **beat.headers,
            MSG_ID_HEADER: dedupe_id(f"lanes.job.{job_id}.submitted", squatted_id),
            "ce-id": squatted_id,
        }
        await squatter.js.publish(beat.subject, beat.payload, headers=headers, stream=JOBS.name)
    outbox = tmp_path / "outbox.ndjson"
    code, _, err = await _lanes_run(
        own_urls.nats_url, "--job", job_id, "--node", "n-test", "--outbox", str(outbox), "--", sys.executable, "-c", ""
    )
    conflicts = tmp_path / "outbox.conflicts.ndjson"
    assert code == 0
    assert not outbox.exists()  # the events after the squatted one were published
    assert "1 events not stored: their ids are held by other events in Lanes (the log says which)" in err
    assert f"they are kept in {conflicts}" in err
    assert "already used by another event" in err  # the log line names what holds the id
    (kept,) = conflicts.read_bytes().splitlines()
    assert decode_structured(kept).id == squatted_id
    events = await timeline_events(stack, job_id)
    assert not any(isinstance(e, JobSubmitted) for e in events)
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


_DUMPS = Path(__file__).resolve().parent.parent / "data" / "flight_recorder" / "hang_rank2"
# A rank that dumps its Flight Recorder buffer where `lanes run` says (a real dump: rank 2 of a gloo job, hung
# before collective 4), then fails.
_DUMPING = (
    "import os, shutil, sys\n"
    f"shutil.copy({str(_DUMPS / 'rank_2.json')!r}, os.environ['TORCH_FR_DUMP_TEMP_FILE'] + '2')\n"
    "print('recorder entries', os.environ['TORCH_FR_BUFFER_SIZE'], flush=True)\n"
    "sys.exit(1)\n"
)


@pytest.mark.parametrize("own_prefix", [False, True], ids=["scratch", "named"])
async def test_a_dump_the_command_wrote_is_its_ranks_evidence(
    stack: Connections, own_urls: ServerUrls, unique: str, tmp_path: Path, own_prefix: bool
) -> None:
    job_id = f"dump-{unique}"
    named = tmp_path / "dumps" / "trace_"
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(named)} if own_prefix else {}
    named.parent.mkdir()
    code, out, _ = await _lanes_run(
        own_urls.nats_url,
        "--job", job_id, "--node", "n-test", "--ranks", "2", "--outbox", str(tmp_path / "outbox.ndjson"),
        "--", sys.executable, "-c", _DUMPING,
        env=env,
    )  # fmt: skip
    assert code == 1
    assert "recorder entries 2000" in out  # the recorder was on in the command's environment

    await eventually(lambda: in_state(own_urls, job_id, "released"), what="the job released", timeout_s=60)

    async def dumped() -> list[JobEvidence]:
        return [
            e
            for e in await timeline_events(stack, job_id)
            if isinstance(e, JobEvidence) and e.data.evidence.summary.startswith("Flight Recorder: ")
        ]

    async def have_dump() -> bool:
        return bool(await dumped())

    await eventually(have_dump, what="the dump's evidence on the timeline", timeout_s=60)
    (evidence,) = await dumped()
    assert (evidence.rank, evidence.data.evidence.last_enqueued) == (2, 3)  # it never entered collective 4
    (exited,) = [e for e in await timeline_events(stack, job_id) if isinstance(e, RankExited)]
    assert exited.data.evidence == 1  # the exit counts the dump: telemetry waits for it before it settles
    # The caller's own dumps stay where it asked for them; the run's scratch ones go with the run.
    assert (named.parent / "trace_2").exists() is own_prefix
