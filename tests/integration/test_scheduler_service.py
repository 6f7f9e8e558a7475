"""The scheduler on real NATS + PostgreSQL: the four wait reasons with history, release once, two instances."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import asyncpg
import pytest
from nats.js import JetStreamContext
from support.cli import LANES, run_lanes_async
from support.waiting import eventually

from lanes_contract.client import LanesClient
from lanes_contract.codec import decode
from lanes_contract.events import (
    AttemptRequested,
    AttemptRequestedData,
    ClusterPolicySet,
    ClusterPolicySetData,
    Event,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    Lane,
    NodeRegistered,
    NodeRegisteredData,
    NodeStateChanged,
    NodeStateChangedData,
    RankAssignment,
)
from lanes_contract.jobs import JobSpec, JobState
from lanes_contract.streams import JOBS, NODES
from lanes_contract.topology import ClusterPolicy, Level, NodeState, Tenant, TopologyConstraint
from lanes_lifecycle.entrypoints.service import SERVICE as LIFECYCLE
from lanes_runtime.consumer import ConsumerSpec, EventConsumer, Outcome
from lanes_runtime.service import Connections, RunnerContext, bind, connected
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_migrations
from lanes_sandbox.embedded import EmbeddedNats
from lanes_scheduler.adapters import repository
from lanes_scheduler.domain.admission import Placed
from lanes_scheduler.domain.queue import gang_of
from lanes_scheduler.entrypoints.service import SERVICE as SCHEDULER
from lanes_scheduler.entrypoints.service import handlers
from lanes_scheduler.service_layer.ports import QueuedAttempt

pytestmark = pytest.mark.real_servers


async def _job_events(js: JetStreamContext, job_id: str) -> list[Event]:
    sub = await js.subscribe(f"lanes.job.{job_id}.>", stream=JOBS.name, ordered_consumer=True)
    events: list[Event] = []
    try:
        info = await js.stream_info(JOBS.name, subjects_filter=f"lanes.job.{job_id}.>")
        total = sum((info.state.subjects or {}).values())
        while len(events) < total:
            msg = await sub.next_msg(timeout=5)
            events.append(decode(msg.subject, msg.headers, msg.data))
    finally:
        await sub.unsubscribe()
    return events


async def _logged(js: JetStreamContext, job_id: str, event_type: str) -> list[Event]:
    """The job's events of one type, once one is on the log: the projection commits before the outbox is
    published, so what a test saw in the projection may not be on the log yet."""
    found: list[Event] = []

    async def logged() -> bool:
        found[:] = [e for e in await _job_events(js, job_id) if e.type == event_type]
        return bool(found)

    await eventually(logged, what=f"{event_type} of {job_id} on the log")
    return found


class Cluster:
    """A scheduler (one or more instances) consuming only this test's jobs and nodes."""

    def __init__(self, conns: Connections, unique: str, jobs: list[str], nodes: list[str]) -> None:
        self.conns = conns
        self.unique = unique
        self.jobs = {j: f"{unique}-{j}" for j in jobs}
        self.nodes = {n: f"{unique}-{n}" for n in nodes}
        self.client = LanesClient(conns.nc, "tests")
        self.consumers: list[EventConsumer] = []

    def specs(self, suffix: str = "") -> list[tuple[ConsumerSpec, object]]:
        job_subjects = tuple(
            f"lanes.job.{j}.{name}"
            for j in self.jobs.values()
            for name in ("submitted", "attempt_requested", "state_changed")
        )
        node_subjects = tuple(
            f"lanes.node.{n}.{name}" for n in self.nodes.values() for name in ("registered", "state_changed")
        )
        node_subjects += (f"lanes.node.{self.policy_node}.policy_set",)
        handle_job_event, handle_node_event = handlers()
        return [
            (
                ConsumerSpec(durable=f"sched-jobs-{self.unique}{suffix}", stream=JOBS, subjects=job_subjects, batch=4),
                handle_job_event,
            ),
            (
                ConsumerSpec(durable=f"sched-nodes-{self.unique}{suffix}", stream=NODES, subjects=node_subjects),
                handle_node_event,
            ),
        ]

    @property
    def policy_node(self) -> str:
        return f"{self.unique}-policy"

    async def node(
        self, name: str, *, gpus: int = 8, leaf: str = "leaf-a", nvlink: str | None = None, model: str = "H100"
    ) -> None:
        data = NodeRegisteredData(
            gpu_model=model, gpus=gpus, gpu_memory_gib=80, leaf=f"{self.unique}-{leaf}", nvlink_domain=nvlink
        )
        await self.client.publish(NodeRegistered(source="tests", node=self.nodes[name], data=data))

    async def submit(self, name: str, **spec: object) -> None:
        job_spec = JobSpec(name="t", **spec)  # type: ignore[arg-type]
        await self.client.publish(
            JobSubmitted(source="tests", jobid=self.jobs[name], attempt=1, data=JobSubmittedData(spec=job_spec))
        )

    async def finish(self, name: str) -> None:
        data = JobStateChangedData(from_state=JobState.RUNNING, to_state=JobState.SUCCEEDED, cause_type="tests")
        await self.client.publish(JobStateChanged(source="tests", jobid=self.jobs[name], attempt=1, data=data))

    async def status(self, name: str) -> str | None:
        return await self.conns.pool.fetchval(  # type: ignore[no-any-return]
            "SELECT status FROM scheduler_jobs WHERE job_id = $1", self.jobs[name]
        )

    async def reason(self, name: str) -> str | None:
        return await self.conns.pool.fetchval(  # type: ignore[no-any-return]
            "SELECT reason FROM scheduler_waits WHERE job_id = $1 AND ended_at IS NULL", self.jobs[name]
        )

    async def nodes_known(self, count: int) -> None:
        async def known() -> bool:
            return int(await self.conns.pool.fetchval("SELECT count(*) FROM scheduler_nodes")) >= count

        await eventually(known, what=f"{count} nodes in the scheduler projection")


@contextlib.asynccontextmanager
async def running(
    urls: ServerUrls, unique: str, jobs: list[str], nodes: list[str], *, instances: int = 1, independent: bool = False
) -> AsyncIterator[Cluster]:
    """Run the scheduler; several instances share one durable, or (`independent`) each reads the whole stream."""
    async with contextlib.AsyncExitStack() as stack:
        conns = [await stack.enter_async_context(connected(urls, name=f"sched-{i}")) for i in range(instances)]
        assert SCHEDULER.migrations is not None
        await apply_migrations(conns[0].pool, "scheduler", SCHEDULER.migrations)
        cluster = Cluster(conns[0], unique, jobs, nodes)
        stop = asyncio.Event()
        tasks = []
        suffixes = [f"-{i}" if independent else "" for i in range(instances)]
        for c, suffix in zip(conns, suffixes, strict=True):
            for spec, handler in cluster.specs(suffix):
                consumer = EventConsumer(c.nc, c.pool, spec, handler)  # type: ignore[arg-type]
                await consumer.provision()
                cluster.consumers.append(consumer)
                tasks.append(asyncio.create_task(consumer.run(stop)))
        try:
            yield cluster
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for spec in {consumer.spec for consumer in cluster.consumers}:
                with contextlib.suppress(Exception):
                    await conns[0].nc.jetstream().delete_consumer(spec.stream.name, spec.durable)


async def test_topology_wait_then_placed_after_a_leaf_is_released_with_history(urls: ServerUrls, unique: str) -> None:
    async with running(urls, unique, ["small", "big"], ["a1", "a2", "a3", "b1"]) as c:
        for name, leaf in (("a1", "leaf-a"), ("a2", "leaf-a"), ("a3", "leaf-a"), ("b1", "leaf-b")):
            await c.node(name, leaf=leaf)
        await c.nodes_known(4)
        # small takes 2 of leaf-a's 3 nodes: 16 GPUs stay free, 8 under each leaf.
        await c.submit("small", workers=2, gpus_per_worker=8)
        await eventually(lambda: _is(c.status("small"), "placed"), what="small placed")
        await c.submit("big", workers=2, gpus_per_worker=8, topology=TopologyConstraint(required=Level.LEAF))
        await eventually(lambda: _is(c.reason("big"), "topology_unsatisfiable"), what="big waits for topology")
        await c.finish("small")
        await eventually(lambda: _is(c.status("big"), "placed"), what="big placed after the release")
        # The projection commits before the outbox is published: wait for the placement on the log too.
        events: list[Event] = []

        async def placed_on_the_log() -> bool:
            events[:] = await _job_events(c.conns.nc.jetstream(), c.jobs["big"])
            return any(e.type == "io.lanes.job.placed.v1" for e in events)

        await eventually(placed_on_the_log, what="big's placement on the log")
        waiting = [e for e in events if e.type == "io.lanes.job.waiting.v1"]
        assert len(waiting) == 1
        data = waiting[0].data
        assert data.reason == "topology_unsatisfiable"
        assert "needs 16 GPUs under one leaf; the largest free leaf has 8" in data.detail
        assert "(" + c.unique + "-leaf-a); 16 free in total" in data.detail
        assert data.blocking[0].kind == "domain"
        assert data.blocking[0].holders == (f"{c.jobs['small']}/1",)
        assert data.owner_lane is Lane.PLATFORM
        assert [e.type for e in events][-1] == "io.lanes.job.placed.v1"
        history = await _history(urls, c.jobs["big"])
        assert [(h["reason"], h["ended_by"]) for h in history] == [("topology_unsatisfiable", "placed")]
        assert history[0]["seconds"] >= 0
        assert history[0]["until"] is not None


async def _is(value: Awaitable[object], expected: str) -> bool:
    return (await value) == expected


async def _history(urls: ServerUrls, job_id: str) -> list[dict[str, Any]]:
    from lanes_cli.scheduling import scheduling_view  # noqa: PLC0415

    async with connected(urls, name="history") as conns, conns.pool.acquire() as conn:
        view = await scheduling_view(conn, job_id)
    return view["wait_history"]  # type: ignore[no-any-return]


async def test_capacity_short_isolated_and_spec_mismatch_reasons(urls: ServerUrls, unique: str) -> None:
    async with running(urls, unique, ["hog", "short", "quota", "cordon", "b200"], ["n1", "n2", "n3"]) as c:
        for name in ("n1", "n2", "n3"):
            await c.node(name)
        await c.nodes_known(3)
        policy = ClusterPolicy(tenants=(Tenant(name="team-q", gpu_quota={"default": 8}),))
        await c.client.publish(
            ClusterPolicySet(source="tests", node=c.policy_node, data=ClusterPolicySetData(policy=policy))
        )
        await c.submit("hog", workers=2, gpus_per_worker=8)
        await eventually(lambda: _is(c.status("hog"), "placed"), what="hog placed")
        await c.submit("short", workers=2, gpus_per_worker=8)
        await eventually(lambda: _is(c.reason("short"), "capacity_short"), what="capacity_short")
        await c.submit("quota", workers=2, gpus_per_worker=8, tenant="team-q")
        await eventually(lambda: _is(c.reason("quota"), "isolated"), what="isolated by quota")
        await c.submit("b200", workers=1, gpus_per_worker=8, gpu_model="B200")
        await eventually(lambda: _is(c.reason("b200"), "spec_mismatch"), what="spec mismatch waits")
        # Cordon the last free node: a 1-node job now waits `isolated`, naming the node, its reason and owner.
        await c.client.publish(
            NodeStateChanged(
                source="tests",
                node=c.nodes["n3"],
                lane=Lane.HOST,
                data=NodeStateChangedData(state=NodeState.CORDONED, reason="GPU Xid 79"),
            )
        )

        async def cordoned() -> bool:
            state = await c.conns.pool.fetchval("SELECT state FROM scheduler_nodes WHERE node_id = $1", c.nodes["n3"])
            return bool(state == "cordoned")

        await eventually(cordoned, what="node cordoned")
        await c.submit("cordon", workers=1, gpus_per_worker=8)
        await eventually(lambda: _is(c.reason("cordon"), "isolated"), what="isolated by cordon")
        js = c.conns.nc.jetstream()
        (short,) = await _logged(js, c.jobs["short"], "io.lanes.job.waiting.v1")
        assert short.data.blocking[0].holders == (f"{c.jobs['hog']}/1",)
        assert short.data.figures == {"needed_gpus": 16, "free_gpus": 8}
        (cordon,) = await _logged(js, c.jobs["cordon"], "io.lanes.job.waiting.v1")
        block = cordon.data.blocking[0]
        assert (block.id, block.state, block.reason, block.owner_lane) == (
            c.nodes["n3"],
            "cordoned",
            "GPU Xid 79",
            Lane.HOST,
        )
        assert cordon.data.owner_lane is Lane.HOST
        quota_events = await _logged(js, c.jobs["quota"], "io.lanes.job.waiting.v1")
        assert quota_events[-1].data.blocking[0].kind == "quota"
        (mismatch,) = await _logged(js, c.jobs["b200"], "io.lanes.job.waiting.v1")
        assert (mismatch.data.reason, mismatch.data.owner_lane) == ("spec_mismatch", Lane.ALGORITHM)


async def test_a_job_submitted_before_any_node_it_fits_is_read_waits_and_is_placed_once_one_is(
    urls: ServerUrls, unique: str
) -> None:
    # Nodes and jobs arrive on different streams: a job read before its nodes (a cold start, a pool being
    # built) must not be rejected for what the scheduler has not read yet.
    async with running(urls, unique, ["early", "b200"], ["h1", "b1"]) as c:
        await c.submit("early", workers=1, gpus_per_worker=8)
        await c.submit("b200", workers=1, gpus_per_worker=8, gpu_model="B200")
        await eventually(lambda: _is(c.reason("early"), "spec_mismatch"), what="waits for any node")
        await c.node("h1")
        await eventually(lambda: _is(c.status("early"), "placed"), what="placed once a node exists")
        await eventually(lambda: _is(c.reason("b200"), "spec_mismatch"), what="still waits for a B200 node")
        await c.node("b1", model="B200")
        await eventually(lambda: _is(c.status("b200"), "placed"), what="placed once a B200 node exists")
        for name in ("early", "b200"):
            events = await _job_events(c.conns.nc.jetstream(), c.jobs[name])
            assert "io.lanes.job.rejected.v1" not in {e.type for e in events}


async def test_a_new_attempt_never_goes_on_the_nodes_its_request_says_to_avoid(urls: ServerUrls, unique: str) -> None:
    async with running(urls, unique, ["j", "hog"], ["n1", "n2", "n3"]) as c:
        await c.node("n1")
        await c.node("n2")
        await c.nodes_known(2)
        await c.submit("j", workers=1, gpus_per_worker=8)
        await eventually(lambda: _is(c.status("j"), "placed"), what="j placed")
        await c.submit("hog", workers=1, gpus_per_worker=8)
        await eventually(lambda: _is(c.status("hog"), "placed"), what="hog placed")
        job = c.jobs["j"]

        async def nodes_of(attempt: int) -> set[str]:
            rows = await c.conns.pool.fetch(
                "SELECT DISTINCT node_id FROM scheduler_allocations WHERE job_id = $1 AND attempt = $2", job, attempt
            )
            return {r["node_id"] for r in rows}

        (failed_node,) = await nodes_of(1)
        failed = JobStateChangedData(from_state=JobState.RUNNING, to_state=JobState.FAILED, cause_type="tests")
        await c.client.publish(JobStateChanged(source="tests", jobid=job, attempt=1, data=failed))
        # The node that failed is free and, as far as the scheduler knows, ready (no cordon has reached it):
        # only the request itself keeps the new attempt off it, so it waits for the one other node to free up.
        retry = AttemptRequestedData(reason="resume after a GPU Xid", avoid_nodes=(failed_node,))
        await c.client.publish(AttemptRequested(source="tests", jobid=job, attempt=2, data=retry))

        async def reason_of_attempt_2() -> str | None:
            return await c.conns.pool.fetchval(  # type: ignore[no-any-return]
                "SELECT reason FROM scheduler_waits WHERE job_id = $1 AND attempt = 2 AND ended_at IS NULL", job
            )

        async def attempt_2_status() -> str | None:
            return await c.conns.pool.fetchval(  # type: ignore[no-any-return]
                "SELECT status FROM scheduler_jobs WHERE job_id = $1 AND attempt = 2", job
            )

        await eventually(lambda: _is(reason_of_attempt_2(), "isolated"), what="attempt 2 isolated by its avoided node")
        (waiting,) = await _logged(c.conns.nc.jetstream(), job, "io.lanes.job.waiting.v1")
        assert f"must avoid: {failed_node}" in waiting.data.detail
        assert [(b.kind, b.id) for b in waiting.data.blocking] == [("node", failed_node)]
        stored = await c.conns.pool.fetchval(
            "SELECT avoid_nodes FROM scheduler_jobs WHERE job_id = $1 AND attempt = 2", job
        )
        assert stored == [failed_node]
        # A new node rebuilds the scheduler's view from the projection: the stored avoid list still holds.
        await c.node("n3")
        await eventually(lambda: _is(attempt_2_status(), "placed"), what="attempt 2 placed once a node is added")
        assert await nodes_of(2) == {c.nodes["n3"]}


async def test_release_is_exactly_once_and_a_double_release_is_refused_and_logged(
    urls: ServerUrls, unique: str
) -> None:
    async with running(urls, unique, ["j"], ["n1"]) as c:
        await c.node("n1")
        await c.nodes_known(1)
        await c.submit("j", workers=1, gpus_per_worker=8)
        await eventually(lambda: _is(c.status("j"), "placed"), what="placed")
        await c.finish("j")
        await c.finish("j")  # a second terminal state change (a new event id): must not free anything again

        async def two_requests() -> bool:
            rows = await c.conns.pool.fetchval("SELECT count(*) FROM scheduler_releases WHERE job_id = $1", c.jobs["j"])
            return int(rows) == 2

        await eventually(two_requests, what="both release requests handled")
        outcomes = await c.conns.pool.fetch(
            "SELECT outcome, gpus FROM scheduler_releases WHERE job_id = $1 ORDER BY at, outcome", c.jobs["j"]
        )
        assert sorted((r["outcome"], r["gpus"]) for r in outcomes) == [("double_release", 0), ("released", 8)]
        released = await _logged(c.conns.nc.jetstream(), c.jobs["j"], "io.lanes.job.resources_released.v1")
        assert len(released) == 1
        assert released[0].data.gpus == 8
        assert await c.conns.pool.fetchval("SELECT count(*) FROM scheduler_allocations") == 0


@pytest.mark.parametrize("independent", [False, True], ids=["shared-durable", "each-reads-everything"])
async def test_two_scheduler_instances_never_double_book(urls: ServerUrls, unique: str, independent: bool) -> None:
    jobs = [f"j{i}" for i in range(24)]
    nodes = [f"n{i}" for i in range(4)]
    async with running(urls, unique, jobs, nodes, instances=2, independent=independent) as c:
        for n in nodes:
            await c.node(n)
        await c.nodes_known(4)
        await asyncio.gather(*(c.submit(j, workers=1, gpus_per_worker=2) for j in jobs))

        async def all_decided() -> bool:
            undecided = await c.conns.pool.fetchval(
                """SELECT count(*) FROM scheduler_jobs j
                   WHERE status = 'pending' AND NOT EXISTS
                     (SELECT 1 FROM scheduler_waits w WHERE w.job_id = j.job_id AND w.ended_at IS NULL)"""
            )
            total = await c.conns.pool.fetchval("SELECT count(*) FROM scheduler_jobs")
            return int(total) == len(jobs) and int(undecided) == 0

        await eventually(all_decided, what="every job placed or waiting")
        js = c.conns.nc.jetstream()
        held: list[tuple[str, int]] = []
        for j in c.jobs.values():
            for event in await _job_events(js, j):
                if event.type == "io.lanes.job.placed.v1":
                    held.extend((a.node, g) for a in event.data.assignments for g in a.gpus)
        assert len(held) == 32  # 16 jobs x 2 GPUs fill the 4 x 8 GPUs, the other 8 wait
        assert len(set(held)) == len(held)
        if independent:
            # Both instances decided on every submission, each on its own connection, at the same time.
            job_consumers = [x for x in c.consumers if x.spec.stream is JOBS]
            assert [x.outcomes[Outcome.PROCESSED] for x in job_consumers] == [len(jobs), len(jobs)]
        placed_rows = await c.conns.pool.fetchval("SELECT count(*) FROM scheduler_jobs WHERE status = 'placed'")
        assert placed_rows == 16


async def test_the_allocation_key_refuses_a_double_booking_even_without_the_lock(urls: ServerUrls, unique: str) -> None:
    async with running(urls, unique, ["a", "b"], ["n1"]) as c:
        await c.node("n1")
        await c.nodes_known(1)
        await c.submit("a", workers=1, gpus_per_worker=8)
        await eventually(lambda: _is(c.status("a"), "placed"), what="a placed")
        spec = JobSpec(name="t", workers=1, gpus_per_worker=8)
        async with c.conns.pool.acquire() as conn, conn.transaction():
            await repository.add_pending_jobs(conn, [QueuedAttempt(c.jobs["b"], 1, spec, 10**9)])
        gang = gang_of(c.jobs["b"], 1, spec, 0)
        assignments = (RankAssignment(rank=0, node=c.nodes["n1"], gpus=(3,)),)
        double_booked = Placed(gang, assignments, Level.NODE, c.nodes["n1"])
        with pytest.raises(asyncpg.UniqueViolationError):
            async with c.conns.pool.acquire() as conn, conn.transaction():
                await repository.allocate(conn, [double_booked])


async def test_lanes_job_json_shows_the_time_spent_in_each_wait_reason(urls: ServerUrls, unique: str) -> None:
    async with running(urls, unique, ["hog", "w"], ["n1"]) as c:
        # The lifecycle service too (its own consumers, narrowed to this test's jobs): `lanes job` reads its view.
        assert LIFECYCLE.migrations is not None
        await apply_migrations(c.conns.pool, "lifecycle", LIFECYCLE.migrations)
        stop = asyncio.Event()
        tasks = []
        for spec, handler in LIFECYCLE.consumers:
            subjects = tuple(s.replace(".*.", f".{j}.") for s in spec.subjects for j in c.jobs.values())
            narrowed = ConsumerSpec(durable=f"{spec.durable}-{unique}", stream=spec.stream, subjects=subjects)
            context = RunnerContext(c.conns.nc, c.conns.pool, c.conns.redis)
            consumer = EventConsumer(c.conns.nc, c.conns.pool, narrowed, bind(handler, context))
            await consumer.provision()
            tasks.append(asyncio.create_task(consumer.run(stop)))
        try:
            await c.node("n1")
            await c.nodes_known(1)
            await c.submit("hog", workers=1, gpus_per_worker=8)
            await eventually(lambda: _is(c.status("hog"), "placed"), what="hog placed")
            await c.submit("w", workers=1, gpus_per_worker=8)
            await eventually(lambda: _is(c.reason("w"), "capacity_short"), what="w waits")
            await c.finish("hog")
            await eventually(lambda: _is(c.status("w"), "placed"), what="w placed")

            async def lifecycle_knows() -> bool:
                found = await c.conns.pool.fetchval(
                    "SELECT count(*) FROM lifecycle_jobs WHERE job_id = $1", c.jobs["w"]
                )
                return int(found) == 1

            await eventually(lifecycle_knows, what="the lifecycle view of w")
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        # `lanes job` reads the projections from PostgreSQL alone.
        result = await run_lanes_async(
            None,
            "job",
            c.jobs["w"],
            "--json",
            env={"DATABASE_URL": urls.database_url, "NATS_URL": None, "REDIS_URL": None},
        )
    assert result.returncode == 0, result.stderr[-2000:]
    scheduling = json.loads(result.stdout)["scheduling"]
    (wait,) = scheduling["wait_history"]
    assert wait["reason"] == "capacity_short"
    assert wait["ended_by"] == "placed"
    assert wait["owner_lane"] == "platform"
    assert wait["blocking"][0]["holders"] == [f"{c.jobs['hog']}/1"]
    assert wait["since"] <= wait["until"]
    assert set(scheduling["seconds_in_reason"]) == {"capacity_short"}
    assert scheduling["wait_reason"] is None


def test_two_scheduler_processes_on_one_stream_never_double_book(urls: ServerUrls, unique: str) -> None:
    """Two `lanes serve scheduler` processes share the durable consumers of one NATS server and one database."""
    with EmbeddedNats() as nats:
        own = ServerUrls(nats_url=nats.url, database_url=urls.database_url, redis_url=urls.redis_url)
        env = os.environ | {
            "NATS_URL": own.nats_url,
            "DATABASE_URL": own.database_url,
            "REDIS_URL": own.redis_url,
            "LANES_LOG_FORMAT": "json",
        }
        procs = [
            subprocess.Popen(
                [LANES, "serve", "scheduler"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        logs = [_drained_when_started(proc) for proc in procs]
        try:
            # Both must be serving before the flood, and before any SIGTERM: a process still importing when
            # it is signalled dies of the signal, which says nothing about the scheduler.
            for started, _ in logs:
                assert started.wait(timeout=120), "a scheduler process never started its consumers"
            held = asyncio.run(_flood(own, unique))
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(timeout=30)
        assert all(proc.returncode == 0 for proc in procs), [
            (proc.returncode, "".join(lines)[-2000:]) for proc, (_, lines) in zip(procs, logs, strict=True)
        ]
    assert len(held) == 6 * 8  # the cluster is full: 6 nodes x 8 GPUs, the rest of the 40 jobs wait
    assert len(set(held)) == len(held)


def _drained_when_started(proc: subprocess.Popen[str]) -> tuple[threading.Event, list[str]]:
    """Read a process's stderr in the background (so it never blocks on a full pipe); the event is set once
    it logs that its consumers started."""
    started, lines = threading.Event(), []

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if '"consumer started"' in line:
                started.set()

    threading.Thread(target=drain, daemon=True).start()
    return started, lines


async def _flood(urls: ServerUrls, unique: str) -> list[tuple[str, int]]:
    async with connected(urls, name="flood") as conns:
        client = LanesClient(conns.nc, "tests")
        jobs = [f"{unique}-p{i}" for i in range(40)]
        for i in range(6):
            data = NodeRegisteredData(gpu_model="H100", gpus=8, gpu_memory_gib=80, leaf=f"leaf-{i % 2}")
            await client.publish(NodeRegistered(source="tests", node=f"{unique}-n{i}", data=data))
        spec = JobSpec(name="t", workers=1, gpus_per_worker=2)
        await asyncio.gather(
            *(
                client.publish(JobSubmitted(source="tests", jobid=j, attempt=1, data=JobSubmittedData(spec=spec)))
                for j in jobs
            )
        )

        async def decided() -> bool:
            try:
                undecided = await conns.pool.fetchval(
                    """SELECT count(*) FROM scheduler_jobs j WHERE status = 'pending' AND NOT EXISTS
                         (SELECT 1 FROM scheduler_waits w WHERE w.job_id = j.job_id AND w.ended_at IS NULL)"""
                )
                total = await conns.pool.fetchval("SELECT count(*) FROM scheduler_jobs")
                placed = await conns.pool.fetchval("SELECT count(*) FROM scheduler_jobs WHERE status = 'placed'")
            except asyncpg.UndefinedTableError:
                return False
            return int(total) == len(jobs) and int(undecided) == 0 and int(placed) == 24

        await eventually(decided, timeout_s=60, what="all 40 jobs placed or waiting")
        js = conns.nc.jetstream()
        held: list[tuple[str, int]] = []

        async def all_published() -> bool:
            # A placement commits before its event is published (the outbox): read the log until all 24 are there.
            held.clear()
            for j in jobs:
                for event in await _job_events(js, j):
                    if event.type == "io.lanes.job.placed.v1":
                        held.extend((a.node, g) for a in event.data.assignments for g in a.gpus)
            return len(held) >= 6 * 8

        await eventually(all_published, timeout_s=60, what="the 24 placements on the log")
        return held
