"""Forged events against a running lifecycle that verifies signers (issue 34, item 3).

The reproduction: from `agent-node-1`'s connection, a `rank_exited` for a rank on node-2, with `ce-source:
lanes/scheduler` and a garbage `Lanes-Signer`, failed the job and SIGTERMed its real ranks. With a keyring,
the lifecycle's consumer verifies each event before its handler: every forgery here is dead-lettered with
its reason (at once, never retried) and the job is untouched; the honest, signed exits still finish the job.
An agent that signs as itself about a rank of another node passes the signature check, and the lifecycle
refuses it instead (the rank was not placed on that node). A node agent, which acts on placements itself,
skips a forged one.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from support.stored_events import job_events_stored
from support.waiting import eventually

from lanes_agent.launcher import LocalLauncher
from lanes_cli.bootstrap import prepare_services
from lanes_contract.client import LanesClient, connect_nats, sign_with
from lanes_contract.codec import EncodedEvent, encode
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
from lanes_contract.jobs import JobSpec, JobState
from lanes_contract.signing import SIGNATURE_HEADER, SIGNER_HEADER
from lanes_contract.streams import DEAD, JOBS
from lanes_lifecycle.adapters import repository
from lanes_runtime.delivery import DEAD_REASON
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.service import connected, run_consumers
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]

LIFECYCLE_DURABLE = "lifecycle-jobs"


@pytest.fixture
async def verifying_lifecycle(secured_nats: EmbeddedNats, urls: ServerUrls) -> AsyncIterator[EmbeddedNats]:
    """The lifecycle as its own identity, signing what it publishes and verifying what it reads."""
    own = ServerUrls(
        nats_url=secured_nats.url_for("lifecycle"), database_url=urls.database_url, redis_url=urls.redis_url
    )
    stop = asyncio.Event()
    async with connected(own, name="lifecycle") as conns:
        sign_with(conns.nc, secured_nats.signer_for("lifecycle"))
        consumers = await prepare_services(conns, ["lifecycle"], keyring=secured_nats.keyring)
        running = asyncio.create_task(run_consumers(consumers, stop))
        try:
            yield secured_nats
        finally:
            stop.set()
            await running


@contextlib.asynccontextmanager
async def signed_as(nats: EmbeddedNats, identity: str) -> AsyncIterator[LanesClient]:
    async with await LanesClient.connect(
        nats.url_for(identity), source=identity, signer=nats.signer_for(identity)
    ) as client:
        yield client


def rank_exit(job: str, rank: int, node: str, exit_code: int, source: str) -> RankExited:
    return RankExited(
        source=source, jobid=job, attempt=1, node=node, rank=rank, data=RankExitedData(exit_code=exit_code)
    )


async def job_state(urls: ServerUrls, job: str) -> JobState | None:
    conn = await asyncpg.connect(urls.database_url)
    try:
        view = await repository.load(conn, job)
    finally:
        await conn.close()
    return view.state if view is not None else None


async def dead_reasons(nats: EmbeddedNats) -> list[str]:
    admin = await connect_nats(nats.url, name="inspector")
    try:
        selection = Selection(DEAD.name, f"lanes.dead.{JOBS.name}.{LIFECYCLE_DURABLE}")
        return [(msg.headers or {}).get(DEAD_REASON, "") async for msg in iter_stream(admin.jetstream(), selection)]
    finally:
        await admin.close()


async def stored_names(nats: EmbeddedNats, job: str) -> set[str]:
    """The names of the job's events on the log (read as the admin)."""
    admin = await connect_nats(nats.url, name="inspector")
    try:
        return {name for name, _ in await job_events_stored(admin.jetstream(), job)}
    finally:
        await admin.close()


async def publish_raw(nats: EmbeddedNats, identity: str, event: EncodedEvent, headers: dict[str, str]) -> None:
    """Publish on `identity`'s connection exactly these headers (the way an attacker would, not via a signer)."""
    nc = await connect_nats(nats.url_for(identity), name=f"as-{identity}")
    try:
        await nc.jetstream().publish(event.subject, event.payload, headers=headers, stream=JOBS.name)
    finally:
        await nc.close()


async def test_forged_rank_exits_are_dead_lettered_with_their_reason_and_honest_ones_still_apply(
    verifying_lifecycle: EmbeddedNats, urls: ServerUrls, unique: str
) -> None:
    nats, job = verifying_lifecycle, f"forged-{unique}"
    spec = JobSpec(name="forgery", workers=2, gpus_per_worker=1)
    async with signed_as(nats, "cli") as cli:
        await cli.publish(JobSubmitted(source="lanes/cli", jobid=job, data=JobSubmittedData(spec=spec)))
    assignments = (RankAssignment(rank=0, node="node-1", gpus=(0,)), RankAssignment(rank=1, node="node-2", gpus=(0,)))
    async with signed_as(nats, "scheduler") as scheduler:
        placement = JobPlacedData(assignments=assignments)
        await scheduler.publish(JobPlaced(source="lanes/scheduler", jobid=job, attempt=1, data=placement))
    for rank, node in ((0, "node-1"), (1, "node-2")):
        async with signed_as(nats, f"agent-{node}") as agent:
            data = RankStartedData(pid=100 + rank)
            await agent.publish(
                RankStarted(source=f"agent/{node}", jobid=job, attempt=1, node=node, rank=rank, data=data)
            )

    async def starting() -> bool:
        return await job_state(urls, job) is JobState.STARTING

    await eventually(starting, timeout_s=30, what="the job placed and its ranks starting")

    # 1. The reproduction: agent-node-1's connection, rank 1 of node-2, claiming the scheduler, garbage signer.
    claimed = encode(rank_exit(job, 1, "node-2", 1, source="lanes/scheduler"))
    garbage = dict(claimed.headers) | {SIGNER_HEADER: "scheduler:k1-forged", SIGNATURE_HEADER: "AAAA"}
    await publish_raw(nats, "agent-node-1", claimed, garbage)
    # 2. A valid signature, by an identity whose role does not cover rank exits (telemetry's key, stolen).
    stolen = nats.signer_for("telemetry").sign(encode(rank_exit(job, 1, "node-2", 1, "agent/node-2")))
    await publish_raw(nats, "agent-node-1", stolen, dict(stolen.headers))
    # 3. agent-node-1 signing as itself, about node-2.
    async with signed_as(nats, "agent-node-1") as agent_1:
        await agent_1.publish(rank_exit(job, 1, "node-2", 1, source="agent/node-1"))
        # 4. ... and naming its own node for a rank it does not run: it verifies, and the lifecycle refuses it.
        await agent_1.publish(rank_exit(job, 1, "node-1", 1, source="agent/node-1"))

    async def three_dead_letters() -> bool:
        return len(await dead_reasons(nats)) == 3

    await eventually(three_dead_letters, timeout_s=30, what="the three forgeries dead-lettered")
    first, second, third = await dead_reasons(nats)
    assert first == "forged: signed by scheduler:k1-forged, a key not in the keyring"
    assert second == "forged: signed by telemetry, whose role may not write " + claimed.subject
    assert third.startswith("forged: signed by agent-node-1, but the event is about node node-2")
    assert await job_state(urls, job) is JobState.STARTING  # none of them failed the job

    # The honest exits, signed by the agents that run the ranks, still apply.
    for rank, node in ((0, "node-1"), (1, "node-2")):
        async with signed_as(nats, f"agent-{node}") as agent:
            await agent.publish(rank_exit(job, rank, node, 0, source=f"agent/{node}"))

    async def succeeded() -> bool:
        return await job_state(urls, job) is JobState.SUCCEEDED

    await eventually(succeeded, timeout_s=30, what="the honest exits to finish the job")
    assert len(await dead_reasons(nats)) == 3


async def test_the_local_launcher_starts_no_rank_for_a_forged_placement(
    secured_nats: EmbeddedNats, unique: str, tmp_path: Path
) -> None:
    """An agent acts on placements directly (it starts ranks): with a keyring it skips a forged one, and runs
    the honest one published after it."""
    nats, forged_job, honest_job = secured_nats, f"forged-{unique}", f"honest-{unique}"
    spec = JobSpec(name="forgery", workers=1, gpus_per_worker=1, command=(sys.executable, "-c", "pass"))
    async with signed_as(nats, "cli") as cli:
        for job in (forged_job, honest_job):
            await cli.publish(JobSubmitted(source="lanes/cli", jobid=job, data=JobSubmittedData(spec=spec)))
    one_rank = JobPlacedData(assignments=(RankAssignment(rank=0, node="node-1", gpus=(0,)),))
    forged = encode(JobPlaced(source="lanes/scheduler", jobid=forged_job, attempt=1, data=one_rank))
    garbage = dict(forged.headers) | {SIGNER_HEADER: "scheduler:k1", SIGNATURE_HEADER: "AAAA"}
    await publish_raw(nats, "observer", forged, garbage)
    async with signed_as(nats, "scheduler") as scheduler:
        await scheduler.publish(JobPlaced(source="lanes/scheduler", jobid=honest_job, attempt=1, data=one_rank))

    nc = await connect_nats(nats.url_for("platform"), name="launcher")
    sign_with(nc, nats.signer_for("platform"))
    stop = asyncio.Event()
    launcher = LocalLauncher(nc, frozenset({"node-1"}), state_dir=tmp_path, heartbeat_s=60, keyring=nats.keyring)
    running = asyncio.create_task(launcher.run(stop))
    try:

        async def honest_rank_exited() -> bool:
            return "rank_exited" in await stored_names(nats, honest_job)

        await eventually(honest_rank_exited, timeout_s=60, what="the honest placement's rank to run and exit")

        async def every_placement_settled() -> bool:
            info = await nc.jetstream().consumer_info(JOBS.name, launcher.name)
            return bool(info.num_pending == 0 and info.num_ack_pending == 0)

        await eventually(every_placement_settled, timeout_s=30, what="the launcher to settle both placements")
    finally:
        stop.set()
        await running
        await nc.close()
    # The forged placement was settled without starting anything: a rank it started would be on the log first.
    assert await stored_names(nats, forged_job) == {"submitted", "placed"}
