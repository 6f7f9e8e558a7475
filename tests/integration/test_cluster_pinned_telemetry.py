"""Two telemetry replicas, each a process of its own, share their durables through a pinned client: one replica
elects a job's first error at a time. The pinned one is killed (SIGKILL) in the middle of a failure storm; the
other takes the pin over, and the job still gets one settled finding, naming the OOM-killed rank, with no
finding published twice under one version and no evidence lost."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import asyncpg
import pytest
from support.ports import free_port
from support.waiting import eventually

from lanes_cli.replicas import ReplicaEnv, ServiceReplicas
from lanes_contract.client import LanesClient
from lanes_contract.codec import decode
from lanes_contract.events import (
    Event,
    EvidenceCategory,
    EvidenceData,
    HostEvidence,
    JobEvidence,
    JobFinding,
    JobPlaced,
    JobPlacedData,
    Lane,
    ProcessEvidence,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    utc_now,
)
from lanes_contract.streams import JOBS, provision_streams
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]

RANKS = 32
GPUS_PER_NODE = 8
VICTIM = 13
PID_BASE = 40_000


def _processed(port: int, consumer: str) -> float:
    """The events a replica's consumer processed, from its /metrics (0 while it does not serve them yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return 0.0
    pattern = rf'lanes_consumer_events_total\{{consumer="{consumer}",outcome="processed"\}} ([0-9.e+]+)'
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


def _storm(job: str, nodes: dict[int, str]) -> tuple[list[Event], list[Event]]:
    """The storm in two halves: timeouts of the first ranks and the kernel's OOM line; the rest, then the exits."""
    now = utc_now()
    timeouts: list[Event] = [
        ProcessEvidence(
            source=f"agent/{node}",
            jobid=job,
            attempt=1,
            rank=rank,
            node=node,
            time=now,
            lane=Lane.NETWORK,
            data=EvidenceData(
                category=EvidenceCategory.COLLECTIVE_TIMEOUT,
                op_type="ALLREDUCE",
                seq_num=90,
                timeout_ms=600_000,
                lines=(f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=90)",),
            ),
        )
        for rank, node in sorted(nodes.items())
        if rank != VICTIM
    ]
    line = f"Memory cgroup out of memory: Killed process {PID_BASE + VICTIM} (python)"
    kernel = HostEvidence(
        source=f"agent/{nodes[VICTIM]}",
        node=nodes[VICTIM],
        time=now,
        data=EvidenceData(category=EvidenceCategory.OOM_KILL, pid=PID_BASE + VICTIM, summary=line, lines=(line,)),
    )
    exits: list[Event] = [
        RankExited(
            source=f"agent/{node}",
            jobid=job,
            attempt=1,
            rank=rank,
            node=node,
            data=RankExitedData(
                exit_code=None,
                signal=signal.SIGKILL if rank == VICTIM else signal.SIGABRT,
                evidence=0 if rank == VICTIM else 1,
            ),
        )
        for rank, node in sorted(nodes.items())
    ]
    half = len(timeouts) // 2
    return [*timeouts[:half], kernel], [*timeouts[half:], *exits]


def _placed_and_started(job: str, nodes: dict[int, str]) -> list[Event]:
    """The placement, as the scheduler publishes it, and each rank's start with its pid, as agents report it."""
    assignments = tuple(
        RankAssignment(rank=rank, node=node, gpus=(rank % GPUS_PER_NODE,)) for rank, node in nodes.items()
    )
    placed = JobPlaced(source="lanes/scheduler", jobid=job, attempt=1, data=JobPlacedData(assignments=assignments))
    started = [
        RankStarted(
            source=f"agent/{node}",
            jobid=job,
            attempt=1,
            rank=rank,
            node=node,
            data=RankStartedData(pid=PID_BASE + rank),
        )
        for rank, node in nodes.items()
    ]
    return [placed, *started]


async def _publish(client: LanesClient, events: Sequence[Event]) -> None:
    await asyncio.gather(*(client.publish(event) for event in events))


async def _job_events(client: LanesClient, job: str) -> list[Event]:
    selection = Selection(JOBS.name, f"lanes.job.{job}.>")
    return [decode(msg.subject, msg.headers, msg.data) async for msg in iter_stream(client.js, selection)]


async def test_killing_the_pinned_telemetry_replica_mid_storm_gives_one_settled_finding(
    own_urls: ServerUrls, tmp_path: Path, unique: str
) -> None:
    job = f"pin-{unique}"
    nodes = {rank: f"pin{unique}-n{rank // GPUS_PER_NODE}" for rank in range(RANKS)}
    client = await LanesClient.connect(own_urls.nats_url, source="lanes/scheduler")
    await provision_streams(client.js)
    ports = {1: free_port(), 2: free_port()}
    replicas = ServiceReplicas(
        ["telemetry"],
        2,
        ReplicaEnv(
            lambda _identity: own_urls.nats_url,
            own_urls.database_url,
            own_urls.redis_url,
            1,
            None,
            # Settled by its evidence (every rank exited), not by the window running out.
            {"LANES_SETTLE_WINDOW_S": "600"},
            per_replica=lambda _service, index: {"LANES_METRICS_PORT": str(ports[index])},
        ),
        tmp_path / "logs",
    )
    try:
        with replicas.running():
            await _publish(client, _placed_and_started(job, nodes))
            first, second = _storm(job, nodes)
            await _publish(client, first)

            # The pinned replica is the one whose evidence consumer processed the first half; the other got none.
            async def one_pinned() -> bool:
                counts = await asyncio.gather(*(asyncio.to_thread(_processed, p, "telemetry") for p in ports.values()))
                return sum(counts) >= len(first) and min(counts) == 0

            await eventually(one_pinned, timeout_s=60, what="the first half of the storm, on one replica")
            counts = {i: await asyncio.to_thread(_processed, p, "telemetry") for i, p in ports.items()}
            pinned = next(r for r in replicas.replicas if counts[r.index] > 0)
            stand_by = next(r for r in replicas.replicas if r is not pinned)
            os.kill(pinned.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            await _publish(client, second)

            async def settled() -> bool:
                findings = [e for e in await _job_events(client, job) if isinstance(e, JobFinding)]
                return any(f.data.settled for f in findings)

            await eventually(settled, timeout_s=120, what="a settled finding after the pinned replica died")
            took_over_s = time.monotonic() - killed_at
            assert stand_by.alive
            taken = await asyncio.to_thread(_processed, ports[stand_by.index], "telemetry")
            print(f"pinned replica killed; the stand-by settled the finding {took_over_s:.1f} s later")  # noqa: T201
            assert taken >= len(second) - RANKS  # the second half's evidence went to the stand-by
    finally:
        events = await _job_events(client, job)
        await client.close()

    findings = [e for e in events if isinstance(e, JobFinding)]
    versions = [f.data.version for f in findings]
    assert len(versions) == len(set(versions)), f"a finding version published twice: {sorted(versions)}"
    settled_findings = [f for f in findings if f.data.settled]
    assert len(settled_findings) == 1, [f.data.settle_reason for f in settled_findings]
    (finding,) = settled_findings
    assert finding.data.first_error is not None
    cause = finding.data.first_error
    assert (cause.category, cause.lane, cause.rank) == (EvidenceCategory.OOM_KILL, Lane.HOST, VICTIM)
    assert finding.data.settle_reason.startswith("every rank"), finding.data.settle_reason
    # No evidence lost: the kernel's line (taken by the killed replica) is on the job's timeline once.
    copies = [e for e in events if isinstance(e, JobEvidence) and e.data.evidence.category is EvidenceCategory.OOM_KILL]
    assert len(copies) == 1
    await _all_stored(own_urls.database_url, [e for e in [*first, *second] if not isinstance(e, RankExited)])


async def _all_stored(database_url: str, evidence: Sequence[Event]) -> None:
    """Every piece of evidence published is in telemetry's table (once: its id is the key)."""
    conn = await asyncpg.connect(database_url)
    try:
        stored = {row["event_id"] for row in await conn.fetch("SELECT event_id FROM telemetry_evidence")}
    finally:
        await conn.close()
    lost = {e.id for e in evidence} - stored
    assert not lost, f"{len(lost)} pieces of evidence lost"
