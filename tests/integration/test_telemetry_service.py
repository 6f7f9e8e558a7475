"""Telemetry on real NATS + PostgreSQL: ingest, correlation by node and time, the finding, offline = live."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from nats.js import JetStreamContext
from support.cli import run_lanes_async
from support.waiting import eventually

from lanes_cli.analyze_cli import finding_json, load_evidence
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
    ResourcesReleased,
    ResourcesReleasedData,
)
from lanes_contract.streams import JOBS
from lanes_evidence.evidence import evidence_event, from_event
from lanes_runtime.consumer import ConsumerSpec, EventConsumer
from lanes_runtime.service import Connections, connected
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_migrations
from lanes_telemetry.adapters.repository import PostgresTelemetryStore
from lanes_telemetry.domain.election import may_be_cause
from lanes_telemetry.entrypoints.service import SERVICE
from lanes_telemetry.service_layer.handlers import CONSEQUENCE_COPIES, handle_evidence, handle_job_event
from lanes_telemetry.views import elect_first_error

pytestmark = pytest.mark.real_servers
OOM_JOB = Path(__file__).resolve().parent.parent / "data" / "logs" / "oom_job"
PLACED_AT = datetime(2026, 12, 2, 9, 50, tzinfo=UTC)


async def _job_events(js: JetStreamContext, job_id: str) -> list[Event]:
    info = await js.stream_info(JOBS.name, subjects_filter=f"lanes.job.{job_id}.>")
    total = sum((info.state.subjects or {}).values())
    if total == 0:
        return []
    sub = await js.subscribe(f"lanes.job.{job_id}.>", stream=JOBS.name, ordered_consumer=True)
    events: list[Event] = []
    try:
        while len(events) < total:
            msg = await sub.next_msg(timeout=5)
            events.append(decode(msg.subject, msg.headers, msg.data))
    finally:
        await sub.unsubscribe()
    return events


@contextlib.asynccontextmanager
async def telemetry(
    urls: ServerUrls, unique: str, nodes: list[str], *, replicas: int = 1
) -> AsyncIterator[Connections]:
    """The telemetry service's two handlers, on consumers that read only this test's nodes and job.

    With `replicas`, each consumer runs that many times on the same durable, as `--scale telemetry=N` would.
    """
    async with connected(urls, name=f"test-telemetry-{unique}") as conns:
        assert SERVICE.migrations is not None
        await apply_migrations(conns.pool, SERVICE.name, SERVICE.migrations)
        specs = [
            (
                ConsumerSpec(
                    durable=f"tel-{unique}",
                    stream=SERVICE.consumers[0][0].stream,
                    subjects=tuple(f"lanes.tel.{node}.>" for node in nodes),
                ),
                handle_evidence,
            ),
            (
                ConsumerSpec(
                    durable=f"tel-placements-{unique}",
                    stream=JOBS,
                    subjects=(f"lanes.job.{unique}-job.placed", f"lanes.job.{unique}-job.resources_released"),
                ),
                handle_job_event,
            ),
        ]
        stop = asyncio.Event()
        consumers = [
            EventConsumer(conns.nc, conns.pool, spec, handler) for spec, handler in specs for _ in range(replicas)
        ]
        tasks = [asyncio.create_task(c.run(stop)) for c in consumers]
        try:
            yield conns
        finally:
            stop.set()
            await asyncio.gather(*tasks)


def _unique_copy(tmp_path: Path, unique: str, source: Path = OOM_JOB) -> Path:
    """A job's logs (the OOM job's by default) with node names made unique to this test (the NATS server is shared)."""
    target = tmp_path / "logs"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("label.toml"))
    for path in sorted(target.rglob("*"), reverse=True):
        if path.is_file():
            path.write_text(path.read_text().replace("node-", f"{unique}-n"))
        if path.is_dir() and path.name.startswith("node-"):
            path.rename(path.with_name(path.name.replace("node-", f"{unique}-n")))
    return target


def _comparable(finding: dict[str, Any]) -> dict[str, Any]:
    return {key: finding[key] for key in ("first_error", "consequences", "stage", "missing_evidence", "confidence")}


async def _live_finding_equals(js: JetStreamContext, job_id: str, offline: dict[str, Any], what: str) -> None:
    """Wait until the job's latest live finding is the offline one."""

    async def finding_matches() -> bool:
        found = [e for e in await _job_events(js, job_id) if isinstance(e, JobFinding)]
        if not found:
            return False
        latest = max(found, key=lambda f: f.data.version)
        return _comparable(latest.data.model_dump(mode="json")) == _comparable(offline)

    await eventually(finding_matches, what=what)


async def _copies_within_cap(js: JetStreamContext, job_id: str, events: Sequence[Event]) -> list[JobEvidence]:
    """The job's evidence copies, once all are published, checked against what telemetry copies.

    Raw lines get no copy on the job's subject; every possible cause gets one; consequences of one category
    get one each up to CONSEQUENCE_COPIES (with two replicas, whichever were stored first).
    """
    meaningful = [e for e in events if from_event(e).category is not EvidenceCategory.RAW]
    assert len(meaningful) < len(events)
    causes = [e for e in meaningful if may_be_cause(from_event(e))]
    consequences: dict[EvidenceCategory, set[str]] = {}
    for e in meaningful:
        if e not in causes:
            consequences.setdefault(from_event(e).category, set()).add(e.id)
    assert max(len(ids) for ids in consequences.values()) > CONSEQUENCE_COPIES  # the cap is exercised
    expected = len(causes) + sum(min(len(ids), CONSEQUENCE_COPIES) for ids in consequences.values())

    async def all_copied() -> bool:  # the replica that stored the last evidence may still be publishing
        return sum(isinstance(e, JobEvidence) for e in await _job_events(js, job_id)) >= expected

    await eventually(all_copied, what="the copies on the job's timeline")
    copies = [e for e in await _job_events(js, job_id) if isinstance(e, JobEvidence)]
    copied_ids = [c.data.evidence_id for c in copies]
    assert len(copied_ids) == len(set(copied_ids))  # each copied once
    assert {e.id for e in causes} <= set(copied_ids)
    for category, ids in consequences.items():
        of_category = [c for c in copies if c.data.evidence_id in ids]
        assert len(of_category) == min(len(ids), CONSEQUENCE_COPIES), category
        assert sum(c.data.last_copy_of_category for c in of_category) == (len(ids) >= CONSEQUENCE_COPIES)
    return copies


async def test_live_finding_equals_lanes_analyze_on_the_same_per_rank_logs(
    urls: ServerUrls, unique: str, tmp_path: Path
) -> None:
    logs = _unique_copy(tmp_path, unique)
    job_id = f"{unique}-job"
    evidence, world = load_evidence([logs], year=2026)
    nodes = sorted(world.all_nodes)
    assert len(nodes) == 4

    offline = await run_lanes_async(None, "analyze", str(logs), "--json", "--year", "2026")
    assert offline.returncode == 0, offline.stderr
    offline_finding = json.loads(offline.stdout)
    assert offline_finding["first_error"]["rank"] == 3
    assert offline_finding["first_error"]["lane"] == "host"

    placement = JobPlaced(
        source="tests",
        jobid=job_id,
        attempt=1,
        time=PLACED_AT,
        data=JobPlacedData(
            assignments=tuple(RankAssignment(rank=r, node=n, gpus=(r % 2,)) for r, n in sorted(world.ranks.items()))  # type: ignore[arg-type]
        ),
    )
    events = [
        evidence_event(e, source="agent/test", node=e.node or "", time=PLACED_AT + timedelta(minutes=5))
        for e in evidence
    ]
    async with telemetry(urls, unique, nodes, replicas=2) as conns:
        client = LanesClient(conns.nc, "tests")
        # Half the evidence is published before the placement: it must be correlated when the placement comes.
        half = len(events) // 2
        for event in events[:half]:
            await client.publish(event)
        await client.publish(placement)
        for event in events[half:]:
            await client.publish(event)

        js = conns.nc.jetstream()
        await _live_finding_equals(js, job_id, offline_finding, "the live finding to equal the offline one")
        copies = await _copies_within_cap(js, job_id, events)
        findings = [e for e in await _job_events(js, job_id) if isinstance(e, JobFinding)]
        assert all(c.attempt == 1 and c.node in nodes for c in copies)
        by_id = {e.id: e for e in events}
        assert all(
            c.rank == by_id[c.data.evidence_id].rank for c in copies if by_id[c.data.evidence_id].rank is not None
        )
        # Versions 1..n, each published once, even with two replicas. How many there are depends on how the
        # evidence was batched on its way in (one batch may carry it all), so only their order is asserted.
        versions = sorted(f.data.version for f in findings)
        assert versions == list(range(1, len(versions) + 1))
        latest = max(findings, key=lambda f: f.data.version)
        assert (latest.lane, latest.node, latest.rank) == (Lane.HOST, f"{unique}-n2", 3)

        stored = await conns.pool.fetchrow(
            "SELECT version, first_node, first_lane FROM telemetry_findings WHERE job_id = $1", job_id
        )
        assert stored is not None
        assert (stored["version"], stored["first_node"], stored["first_lane"]) == (
            latest.data.version,
            f"{unique}-n2",
            "host",
        )
        count = await conns.pool.fetchval("SELECT count(*) FROM telemetry_evidence WHERE job_id = $1", job_id)
        assert count == len(events)


NEW_FORMATS = (
    "alg_oom_two_nodes",
    "alg_megatron_nan_grad_nested_prefix",
    "net_socket_start_connect_first",
    "plat_dataloader_shm_bus_error",
    "host_xid79_fallen_off_bus",
    "net_peer_closed_peer_was_waiting",
)
"""Corpus cases in the newer formats (nested prefixes, NCCL connect failures, shm bus errors, a journal Xid,
a peer that was alive) whose every piece of evidence carries a node and a time, as a live agent's would."""


@pytest.mark.parametrize("case", NEW_FORMATS)
async def test_live_finding_equals_lanes_analyze_on_new_formats(
    urls: ServerUrls, unique: str, tmp_path: Path, case: str
) -> None:
    logs = _unique_copy(tmp_path, unique, OOM_JOB.parent / case)
    job_id = f"{unique}-job"
    evidence, world = load_evidence([logs])
    offline = finding_json(elect_first_error(evidence, world=world))
    assert offline["first_error"] is not None
    assert all(e.node and e.time for e in evidence)
    placed_at = min(e.time for e in evidence if e.time) - timedelta(minutes=1)
    placement = JobPlaced(
        source="tests",
        jobid=job_id,
        attempt=1,
        time=placed_at,
        data=JobPlacedData(
            assignments=tuple(RankAssignment(rank=r, node=n, gpus=(0,)) for r, n in sorted(world.ranks.items()))  # type: ignore[arg-type]
        ),
    )
    events = [evidence_event(e, source="agent/test", node=e.node or "", time=placed_at) for e in evidence]
    async with telemetry(urls, unique, sorted(world.all_nodes)) as conns:
        client = LanesClient(conns.nc, "tests")
        await client.publish(placement)
        for event in events:
            await client.publish(event)
        await _live_finding_equals(
            conns.nc.jetstream(), job_id, offline, f"the live finding of {case} to equal the offline one"
        )


async def test_a_batch_locks_its_nodes_and_reads_their_placements_in_one_statement_each(
    urls: ServerUrls, unique: str
) -> None:
    first, second, idle = f"{unique}-a", f"{unique}-b", f"{unique}-idle"
    job_id = f"{unique}-job"
    async with connected(urls, name=f"test-spans-{unique}") as conns:
        assert SERVICE.migrations is not None
        await apply_migrations(conns.pool, SERVICE.name, SERVICE.migrations)
        async with conns.pool.acquire() as conn, conn.transaction():
            store = PostgresTelemetryStore(conn)
            await store.lock_nodes([second, first, second], exclusive=True)
            held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
            assert await conn.fetchval(held) == 2  # one per distinct node, until the commit
            ranks = (RankAssignment(rank=0, node=first, gpus=(0,)), RankAssignment(rank=1, node=second, gpus=(0,)))
            await store.save_placement(job_id, 1, ranks, PLACED_AT)
            await store.release(job_id, 1, PLACED_AT + timedelta(minutes=1))
            during = await store.placement_spans([first, second, idle], PLACED_AT, PLACED_AT + timedelta(minutes=5))
            after = await store.placement_spans([first, idle], PLACED_AT + timedelta(minutes=2), PLACED_AT)
        assert {node: [(s.job_id, s.rank) for s in spans] for node, spans in during.items()} == {
            first: [(job_id, 0)],
            second: [(job_id, 1)],
            idle: [],
        }
        assert after == {first: [], idle: []}  # released before the window: every node still named


async def test_evidence_batches_share_a_node_and_a_placement_waits_for_them(urls: ServerUrls, unique: str) -> None:
    """Two transactions storing a node's evidence go side by side; a placement on it waits for both to commit.

    The placement correlates the evidence stored before it: evidence still uncommitted would be missed.
    """
    node = f"{unique}-n"
    async with connected(urls, name=f"test-node-locks-{unique}") as conns:
        assert SERVICE.migrations is not None
        await apply_migrations(conns.pool, SERVICE.name, SERVICE.migrations)
        async with conns.pool.acquire() as first, conns.pool.acquire() as second, conns.pool.acquire() as placing:
            async with first.transaction():
                await PostgresTelemetryStore(first).lock_nodes([node], exclusive=False)
                async with second.transaction():
                    # Not blocked by the first: a statement timeout would fail this if it were.
                    await second.execute("SET LOCAL statement_timeout = '5s'")
                    await PostgresTelemetryStore(second).lock_nodes([node], exclusive=False)
                    async with placing.transaction():
                        await placing.execute("SET LOCAL lock_timeout = '100ms'")
                        with pytest.raises(asyncpg.LockNotAvailableError):
                            await PostgresTelemetryStore(placing).lock_nodes([node], exclusive=True)
                async with placing.transaction():  # the second committed; the first still holds the node
                    await placing.execute("SET LOCAL lock_timeout = '100ms'")
                    with pytest.raises(asyncpg.LockNotAvailableError):
                        await PostgresTelemetryStore(placing).lock_nodes([node], exclusive=True)
            async with placing.transaction():  # both committed
                await placing.execute("SET LOCAL statement_timeout = '5s'")
                await PostgresTelemetryStore(placing).lock_nodes([node], exclusive=True)


async def test_evidence_outside_the_placement_window_stays_uncorrelated(urls: ServerUrls, unique: str) -> None:
    node = f"{unique}-solo"
    job_id = f"{unique}-job"
    async with telemetry(urls, unique, [node]) as conns:
        client = LanesClient(conns.nc, "tests")
        js = conns.nc.jetstream()

        def exited(at: datetime) -> ProcessEvidence:
            data = EvidenceData(category=EvidenceCategory.PROCESS_EXITED, signal=9, lines=("killed",))
            return ProcessEvidence(source="agent/test", node=node, time=at, lane=Lane.HOST, data=data)

        early = exited(PLACED_AT - timedelta(hours=1))
        await client.publish(early)
        await client.publish(
            JobPlaced(
                source="tests",
                jobid=job_id,
                attempt=1,
                time=PLACED_AT,
                data=JobPlacedData(assignments=(RankAssignment(rank=0, node=node, gpus=(0,)),)),
            )
        )
        during = exited(PLACED_AT + timedelta(minutes=1))
        await client.publish(during)

        async def stored(*ids: str) -> bool:
            n = await conns.pool.fetchval(
                "SELECT count(*) FROM telemetry_evidence WHERE event_id = ANY($1::text[])", list(ids)
            )
            return bool(n == len(ids))

        await eventually(lambda: stored(early.id, during.id), what="both pieces of evidence stored")
        await client.publish(
            ResourcesReleased(
                source="tests",
                jobid=job_id,
                attempt=1,
                time=PLACED_AT + timedelta(hours=1),
                data=ResourcesReleasedData(nodes=(node,), gpus=1),
            )
        )

        async def released() -> bool:
            at = await conns.pool.fetchval("SELECT released_at FROM telemetry_placements WHERE job_id = $1", job_id)
            return at is not None

        await eventually(released, what="the placement released")
        after = exited(PLACED_AT + timedelta(hours=2))
        await client.publish(after)
        await eventually(lambda: stored(after.id), what="the evidence after the release stored")

        async def copied() -> bool:
            return any(isinstance(e, JobEvidence) for e in await _job_events(js, job_id))

        await eventually(copied, what="the correlated copy")
        rows = {
            r["event_id"]: (r["job_id"], r["rank"])
            for r in await conns.pool.fetch(
                "SELECT event_id, job_id, rank FROM telemetry_evidence WHERE node = $1", node
            )
        }
        # The node runs one rank during the job: node-level evidence then is rank 0's. Before and after: nobody's.
        assert rows == {early.id: (None, None), during.id: (job_id, 0), after.id: (None, None)}
        copies = [e for e in await _job_events(js, job_id) if isinstance(e, JobEvidence)]
        assert [c.data.evidence_id for c in copies] == [during.id]


async def test_a_node_that_is_first_error_in_several_jobs_is_flagged_as_a_repeat_offender(
    urls: ServerUrls, unique: str
) -> None:
    node = f"{unique}-bad"
    async with telemetry(urls, unique, [node]) as conns:
        client = LanesClient(conns.nc, "tests")
        js = conns.nc.jetstream()
        jobs = [f"{unique}-a", f"{unique}-b"]
        for job_id in jobs:
            data = EvidenceData(category=EvidenceCategory.GPU_XID, xid=79, lines=("NVRM: Xid (PCI:0000:3b:00): 79",))
            await client.publish(
                HostEvidence(source="agent/test", node=node, jobid=job_id, attempt=1, rank=0, time=PLACED_AT, data=data)
            )

            async def has_finding(job_id: str = job_id) -> bool:
                return any(isinstance(e, JobFinding) for e in await _job_events(js, job_id))

            await eventually(has_finding, what=f"a finding for {job_id}")
        first, second = [next(e for e in await _job_events(js, job_id) if isinstance(e, JobFinding)) for job_id in jobs]
        assert first.data.first_error is not None
        assert second.data.first_error is not None
        assert "repeat offender" not in first.data.first_error.summary
        assert f"repeat offender: {node} was the first error of 1 other job(s)" in second.data.first_error.summary


async def test_two_transactions_counting_consequences_of_one_category_never_both_take_the_same_numbers(
    urls: ServerUrls, unique: str
) -> None:
    # Two replicas copying consequences of one attempt: the second waits for the first's row lock and counts
    # on from its committed number, so together they copy no more than the cap. A rolled-back count is undone.
    key = (f"{unique}-job", 1, "collective_timeout")
    async with connected(urls, name=f"test-copies-{unique}") as conns:
        assert SERVICE.migrations is not None
        await apply_migrations(conns.pool, SERVICE.name, SERVICE.migrations)
        async with conns.pool.acquire() as first, conns.pool.acquire() as second:
            async with first.transaction():
                assert await PostgresTelemetryStore(first).count_consequences({key: 5}) == {key: 0}

                async def count_in_second() -> dict[tuple[str, int, str], int]:
                    async with second.transaction():
                        return await PostgresTelemetryStore(second).count_consequences({key: 5})

                second_pid = await second.fetchval("SELECT pg_backend_pid()")
                waiting = asyncio.create_task(count_in_second())

                async def blocked() -> bool:  # the second waits on the first transaction's row lock
                    return bool(
                        await conns.pool.fetchval(
                            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", second_pid
                        )
                    )

                await eventually(blocked, what="the second count waiting for the first's row lock")
                assert not waiting.done()
            assert await waiting == {key: 5}
            with contextlib.suppress(RuntimeError):
                async with first.transaction():
                    assert await PostgresTelemetryStore(first).count_consequences({key: 1}) == {key: 10}
                    raise RuntimeError  # roll back
        assert (
            await conns.pool.fetchval(
                "SELECT counted FROM telemetry_consequences WHERE job_id = $1 AND attempt = 1", key[0]
            )
            == 10
        )
