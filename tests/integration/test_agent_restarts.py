"""The node agent (`lanes agent`, a process of its own) killed, restarted and cut off from the bus.

Scheduler, lifecycle and telemetry run in this test's process against a NATS server of the test's own. The
agent runs as a separate `lanes agent` process with a ledger directory. Every rank appends one line to a
file when it starts, so "no rank runs twice" is read from what really ran, not from the events.

In each case every job reaches a terminal state, every rank ran at most once, and no GPU stays allocated.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from support.cli import lanes_process, local_stack
from support.stored_events import job_events_stored
from support.waiting import eventually

from lanes_agent.ledger import process_start
from lanes_cli.agent_cli import durable_name
from lanes_cli.demo import DEMO_NODES
from lanes_cli.timeline import job_timeline
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.codec import decode
from lanes_contract.events import (
    EvidenceCategory,
    JobFinding,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobSubmitted,
    JobSubmittedData,
    Lane,
    RankAssignment,
    RankExited,
)
from lanes_contract.jobs import FailureCause, JobSpec, JobState
from lanes_contract.streams import DEAD, JOBS, TELEMETRY
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]
KMSG = Path("/dev/kmsg")
_TERMINAL = {JobState.RELEASED.value, JobState.SUCCEEDED.value, JobState.FAILED.value, JobState.CANCELLED.value}


def _rank_program(starts: Path, seconds: float, later_attempts_s: float | None = None) -> str:
    """A rank that appends which rank of which attempt started to `starts`, is ready, and runs `seconds`
    (`later_attempts_s` in the attempts after the first)."""
    later = seconds if later_attempts_s is None else later_attempts_s
    return (
        "import os, time\n"
        f"with open({str(starts)!r}, 'a') as f:\n"
        "    f.write(f\"{os.environ['LANES_JOB_ID']} {os.environ['LANES_ATTEMPT']} {os.environ['RANK']} "
        '{os.getpid()}\\n")\n'
        "print('lanes: communicator ready', flush=True)\n"
        f"time.sleep({seconds} if os.environ['LANES_ATTEMPT'] == '1' else {later})\n"
    )


def _started(starts: Path) -> Counter[tuple[str, str, str]]:
    lines = starts.read_text().splitlines() if starts.exists() else []
    return Counter(tuple(line.split()[:3]) for line in lines)  # type: ignore[misc]


def _pids(starts: Path) -> list[int]:
    return [int(line.split()[3]) for line in starts.read_text().splitlines()]


def _agent(nats_url: str, state_dir: Path, *extra: str) -> AbstractAsyncContextManager[asyncio.subprocess.Process]:
    """`lanes agent` for the demo's four nodes, as its own process."""
    nodes = [arg for node in DEMO_NODES for arg in ("--node", node)]
    args = ("agent", *nodes, "--state-dir", str(state_dir), "--stop-grace", "1", *extra)
    return lanes_process(*args, env={"NATS_URL": nats_url})


async def _states(conns: Connections, job_ids: list[str]) -> dict[str, str]:
    rows = await conns.pool.fetch("SELECT job_id, state FROM lifecycle_jobs WHERE job_id = ANY($1::text[])", job_ids)
    return {row["job_id"]: row["state"] for row in rows}


async def _submit(conns: Connections, job_ids: list[str], spec: JobSpec) -> None:
    client = LanesClient(conns.nc, "tests")
    for job_id in job_ids:
        await client.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))


async def _all_running(conns: Connections, job_ids: list[str], starts: Path, ranks: int) -> None:
    async def running() -> bool:
        states = await _states(conns, job_ids)
        return (
            set(states.values()) == {"running"}
            and len(states) == len(job_ids)
            and sum(_started(starts).values()) == ranks
        )

    await eventually(running, timeout_s=120, what="every job running, every rank started")


async def _all_ended(conns: Connections, job_ids: list[str]) -> dict[str, str]:
    async def ended() -> bool:
        states = await _states(conns, job_ids)
        return len(states) == len(job_ids) and set(states.values()) <= _TERMINAL

    await eventually(ended, timeout_s=180, what="every job in a terminal state")
    return await _states(conns, job_ids)


async def _no_gpu_held(conns: Connections, job_ids: list[str]) -> None:
    async def released() -> bool:
        held = await conns.pool.fetchval(
            "SELECT count(*) FROM scheduler_allocations WHERE job_id = ANY($1::text[])", job_ids
        )
        return int(held) == 0

    await eventually(released, timeout_s=60, what="every GPU of the jobs released")


async def _dead_letters(conns: Connections) -> list[dict[str, str]]:
    js = conns.nc.jetstream()
    last = (await js.stream_info(DEAD.name)).state.last_seq
    return [dict((await js.get_msg(DEAD.name, seq)).headers or {}) for seq in range(1, last + 1)]


@pytest.fixture
async def stack(own_urls: ServerUrls) -> AsyncIterator[Connections]:
    """Scheduler, lifecycle and telemetry in this process, the demo's nodes registered; no agent."""
    async with local_stack(own_urls, ["scheduler", "lifecycle", "telemetry"], agent=False) as conns:
        yield conns


@pytest.fixture
async def stack_with_recovery(own_urls: ServerUrls) -> AsyncIterator[Connections]:
    """The stack and recovery: a failed attempt is retried, and the next placement goes to the agent."""
    services = ["scheduler", "lifecycle", "telemetry", "recovery"]
    async with local_stack(own_urls, services, agent=False) as conns:
        yield conns


async def test_an_agent_killed_with_8_ranks_running_settles_them_on_restart_and_runs_none_twice(
    own_urls: ServerUrls, stack_with_recovery: Connections, tmp_path: Path
) -> None:
    stack = stack_with_recovery
    starts = tmp_path / "starts"
    job_ids = [f"agent-kill-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    # Attempt 1 runs until it is lost with the agent; the retry, placed after the restart, finishes in a second.
    program = _rank_program(starts, 600, later_attempts_s=1)
    spec = JobSpec(name="long", workers=4, command=(sys.executable, "-c", program))
    state = tmp_path / "agent"
    async with _agent(own_urls.nats_url, state) as first:
        await _submit(stack, job_ids, spec)
        await _all_running(stack, job_ids, starts, 8)
        first.kill()  # kill -9: no chance to stop its ranks or acknowledge anything
        await first.wait()
    orphans = _pids(starts)
    assert all(process_start(pid) is not None for pid in orphans)  # the ranks outlived their agent

    async with _agent(own_urls.nats_url, state):
        # The jobs end through their retries, which the restarted agent runs from specs it reads off the log.
        async def retried_and_ended() -> bool:
            rows = await stack.pool.fetch(
                "SELECT state FROM lifecycle_jobs WHERE job_id = ANY($1::text[]) AND attempt = 2", job_ids
            )
            return len(rows) == len(job_ids) and {row["state"] for row in rows} <= {"succeeded", "released"}

        await eventually(retried_and_ended, timeout_s=180, what="every job retried and finished")
        await _no_gpu_held(stack, job_ids)
        assert [pid for pid in orphans if process_start(pid) is not None] == []  # the restarted agent killed them
    assert max(_started(starts).values()) == 1  # no rank of any attempt ran twice
    assert {attempt for _, attempt, _ in _started(starts)} == {"1", "2"}
    assert sum(_started(starts).values()) == 16
    for job_id in job_ids:
        events = [e.event for e in await job_timeline(stack.nc.jetstream(), job_id) if e.event is not None]
        exits = [e for e in events if isinstance(e, RankExited) and e.attempt == 1]
        assert sorted(e.rank or 0 for e in exits) == [0, 1, 2, 3]  # each rank's exit once (ids dedupe repeats)
        assert all(e.data.lost is not None and "killed" in e.data.lost for e in exits)
        failed = next(e for e in events if isinstance(e, JobStateChanged) and e.data.to_state is JobState.FAILED)
        assert failed.data.cause is FailureCause.PLATFORM_ACTION
        assert "lost by its agent" in failed.data.reason
        finding = await _settled_finding(stack, job_id, attempt=1)
        assert finding is not None
        assert finding.lane is Lane.PLATFORM
        assert finding.data.first_error is not None
        assert finding.data.first_error.category == EvidenceCategory.AGENT_FAULT.value


async def _settled_finding(conns: Connections, job_id: str, attempt: int = 1) -> JobFinding | None:
    events = [e.event for e in await job_timeline(conns.nc.jetstream(), job_id) if e.event is not None]
    settled = [e for e in events if isinstance(e, JobFinding) and e.data.settled and e.attempt == attempt]
    return settled[-1] if settled else None


@contextlib.contextmanager
def _frozen(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) inside the block: every request to it hangs, as with a dead server."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_nats_down_for_10_s_while_ranks_finish_loses_no_exit_and_reruns_no_rank(
    urls: ServerUrls, tmp_path: Path
) -> None:
    starts = tmp_path / "starts"
    job_ids = [f"bus-outage-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    spec = JobSpec(name="short", workers=2, command=(sys.executable, "-c", _rank_program(starts, 3)))
    with EmbeddedNats() as nats:
        own = ServerUrls(nats.url, urls.database_url, urls.redis_url)
        async with (
            local_stack(own, ["scheduler", "lifecycle", "telemetry"], agent=False) as conns,
            _agent(own.nats_url, tmp_path / "agent") as agent,
        ):
            await _submit(conns, job_ids, spec)
            await _all_running(conns, job_ids, starts, 6)
            assert nats.pid is not None
            with _frozen(nats.pid):
                await asyncio.sleep(10)  # every rank exits in here, with nobody to tell
            states = await _all_ended(conns, job_ids)
            await _no_gpu_held(conns, job_ids)
            assert agent.returncode is None  # the agent rode the outage out
            assert await _dead_letters(conns) == []
        assert set(states.values()) <= {JobState.SUCCEEDED.value, JobState.RELEASED.value}, states
        assert max(_started(starts).values()) == 1
        assert sum(_started(starts).values()) == 6


def _write_kmsg(line: str) -> None:
    with KMSG.open("w") as kmsg:
        kmsg.write(f"<3>{line}\n")  # a record is complete at its newline


@pytest.mark.skipif(not os.access(KMSG, os.R_OK | os.W_OK), reason="needs a readable, writable /dev/kmsg (root)")
async def test_an_agent_restarted_mid_job_neither_loses_nor_repeats_kernel_log_evidence(
    own_urls: ServerUrls, stack: Connections, tmp_path: Path
) -> None:
    starts = tmp_path / "starts"
    job_id = f"kmsg-restart-{uuid.uuid4().hex[:6]}"
    spec = JobSpec(name="long", workers=1, command=(sys.executable, "-c", _rank_program(starts, 600)))
    state = tmp_path / "agent"
    js = stack.nc.jetstream()

    async def xid_lines() -> list[int]:
        found: list[int] = []
        sub = await js.subscribe("lanes.tel.>", stream=TELEMETRY.name, ordered_consumer=True)
        try:
            while True:
                msg = await sub.next_msg(timeout=1)
                event = decode(msg.subject, msg.headers, msg.data)
                if event.jobid == job_id and event.data.xid is not None:
                    found.append(event.data.xid)
        except TimeoutError:
            return found
        finally:
            await sub.unsubscribe()

    async with _agent(own_urls.nats_url, state, "--kernel-log", str(KMSG)) as first:
        await _submit(stack, [job_id], spec)
        await _all_running(stack, [job_id], starts, 1)
        (pid,) = _pids(starts)
        await asyncio.sleep(1)  # the follower has opened the log (it starts from "now")
        _write_kmsg(f"NVRM: Xid (PCI:0000:3b:00): 13, pid={pid}, name=python, Graphics SM Warp Exception")

        async def first_line_read() -> bool:
            return len(await xid_lines()) == 1

        await eventually(first_line_read, timeout_s=30, what="the first Xid line as the rank's evidence")
        first.kill()
        await first.wait()
    # Written while no agent runs: the restarted agent reads it from its stored position, and reads the
    # first line no second time.
    _write_kmsg(f"NVRM: Xid (PCI:0000:3b:00): 31, pid={pid}, name=python, Ch 00000008, MMU Fault: ENGINE GRAPHICS")
    async with _agent(own_urls.nats_url, state, "--kernel-log", str(KMSG)):

        async def second_line_read() -> bool:
            return len(await xid_lines()) >= 2

        await eventually(second_line_read, timeout_s=30, what="the line written while the agent was down")
        await _all_ended(stack, [job_id])
        await asyncio.sleep(1)  # anything repeated would have arrived by now, beside the second line
        found = await xid_lines()
    assert found == [13, 31]  # each line once, in order; none lost, none repeated


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
async def test_an_agent_back_later_than_the_duplicate_window_stores_each_rank_event_once(
    secured_nats: EmbeddedNats, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    """The agent is stopped (or killed) with its ranks running and comes back after JetStream's duplicate
    window: the lost ranks' settlement and the placement's redelivery report only what the log lacks."""
    nc = await connect_nats(secured_nats.url, name="tests")
    js = nc.jetstream()
    # No service runs here to provision the streams back to their 10-minute window.
    window_s = 1.0
    config = (await js.stream_info(JOBS.name)).config
    config.duplicate_window = window_s
    await js.update_stream(config)
    job_id = f"late-restart-{uuid.uuid4().hex[:6]}"
    starts = tmp_path / "starts"
    spec = JobSpec(name="long", workers=2, command=(sys.executable, "-c", _rank_program(starts, 600)))
    client = LanesClient(nc, "tests")
    await client.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
    nodes = sorted(DEMO_NODES)
    assignments = tuple(RankAssignment(rank=rank, node=nodes[rank], gpus=(0,)) for rank in range(2))
    placed = JobPlaced(source="tests", jobid=job_id, attempt=1, data=JobPlacedData(assignments=assignments))
    await client.publish(placed)
    state = tmp_path / "agent"

    async def reported(name: str) -> int:
        return sum(count for (kind, _), count in (await job_events_stored(js, job_id)).items() if kind == name)

    try:
        async with _agent(secured_nats.url, state) as first:
            await eventually(
                lambda: _equals(reported("rank_started"), 2), timeout_s=60, what="both ranks started and reported"
            )
            first.send_signal(stop_signal)  # the placement stays unacknowledged: it comes back to the next run
            await first.wait()
        await asyncio.sleep(2 * window_s)  # back later than the window: JetStream has forgotten every id

        async with _agent(secured_nats.url, state):

            async def placement_settled() -> bool:
                info = await js.consumer_info(JOBS.name, durable_name(list(DEMO_NODES)))
                done = info.num_pending == 0 and info.num_ack_pending == 0
                return done and await reported("rank_exited") >= len(assignments)

            await eventually(placement_settled, timeout_s=120, what="the placement redelivered and acknowledged")
        stored = await job_events_stored(js, job_id)
        assert (await js.stream_info(JOBS.name)).config.duplicate_window == window_s
    finally:
        await nc.close()
    assert max(_started(starts).values()) == 1  # no rank ran twice
    kinds = Counter(kind for kind, _ in stored.elements())
    assert (kinds["rank_started"], kinds["rank_exited"]) == (2, 2)
    assert [key for key, count in stored.items() if count > 1] == []


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_a_rank_that_cannot_start_fails_its_job_in_the_platform_lane_and_holds_no_gpu(
    own_urls: ServerUrls, stack: Connections, tmp_path: Path
) -> None:
    job_id = f"no-binary-{uuid.uuid4().hex[:6]}"
    spec = JobSpec(name="no-binary", workers=2, command=(str(tmp_path / "no-such-trainer"),))
    async with _agent(own_urls.nats_url, tmp_path / "agent"):
        await _submit(stack, [job_id], spec)
        states = await _all_ended(stack, [job_id])
        await _no_gpu_held(stack, [job_id])

        async def settled() -> bool:
            return await _settled_finding(stack, job_id) is not None

        await eventually(settled, timeout_s=60, what="a settled finding")
    assert states[job_id] in {JobState.FAILED.value, JobState.RELEASED.value}
    finding = await _settled_finding(stack, job_id)
    assert finding is not None
    assert finding.lane is Lane.PLATFORM
    assert finding.data.first_error is not None
    assert finding.data.first_error.category == EvidenceCategory.AGENT_FAULT.value
    assert "no-such-trainer" in finding.data.first_error.summary  # the OS error, as the agent saw it
    letters = await _dead_letters(stack)
    assert letters  # the placement, dead-lettered with the reason
    assert all("cannot be started" in letter["Lanes-Dead-Reason"] for letter in letters)
