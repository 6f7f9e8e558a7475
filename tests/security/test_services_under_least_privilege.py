"""The services run end to end, each as its own identity, under the permissions the attack tests hold them to.

`lanes up` runs every service as `platform`, which owns every consumer; the compose stack runs each as its
own identity. Here scheduler, lifecycle (with its job API), telemetry, recovery and the audit recorder each
connect as themselves to a NATS with auth: a job submitted by the CLI through the job API is placed, its state
changes, the audit copies it, and no service was refused anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import asyncpg
import pytest
from nats.js.errors import NotFoundError
from support.waiting import eventually

from lanes_cli.bootstrap import SERVICES
from lanes_contract.client import LanesClient, connect_nats, denied_operations
from lanes_contract.events import NodeRegistered, NodeRegisteredData
from lanes_contract.streams import JOBS, NODES
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.service import connected, prepare_services, run_consumers
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]

EACH_AS_ITSELF = ("scheduler", "lifecycle", "telemetry", "recovery", "audit")


async def last_on(nats: EmbeddedNats, subject: str) -> int | None:
    """The sequence of the last message on `subject` in the job stream, read as the admin; None if there is none."""
    admin = await connect_nats(nats.url, name="inspector")
    try:
        return int((await admin.jetstream().get_last_msg(JOBS.name, subject)).seq or 0)
    except NotFoundError:
        return None
    finally:
        await admin.close()


async def scheduler_knows(database_url: str, node: str) -> bool:
    """Whether the scheduler's inventory holds `node`."""
    conn = await asyncpg.connect(database_url)
    try:
        return bool(await conn.fetchval("SELECT count(*) FROM scheduler_nodes WHERE node_id = $1", node))
    finally:
        await conn.close()


async def everything_on(nats: EmbeddedNats) -> list[str]:
    """Every message of the job and node streams, as `<subject>: <data>` (read as the admin), for a failure."""
    admin = await connect_nats(nats.url, name="inspector")
    try:
        return [
            f"{msg.subject}: {msg.data.decode(errors='replace')[:300]}"
            for stream in (JOBS.name, NODES.name)
            async for msg in iter_stream(admin.jetstream(), Selection(stream, ">"))
        ]
    finally:
        await admin.close()


async def test_each_service_as_its_own_identity_places_a_job_the_cli_submitted(
    secured_nats: EmbeddedNats, urls: ServerUrls, unique: str
) -> None:
    job = f"least-{unique}"
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        services = []
        for name in EACH_AS_ITSELF:
            own = ServerUrls(
                nats_url=secured_nats.url_for(name), database_url=urls.database_url, redis_url=urls.redis_url
            )
            conns = await stack.enter_async_context(connected(own, name=name))
            services.append((conns.nc, await prepare_services(conns, [SERVICES[name]])))
        running = [asyncio.create_task(run_consumers(runners, stop)) for _, runners in services]
        try:
            async with await LanesClient.connect(secured_nats.url_for("cli"), source="lanes/cli") as cli:
                data = NodeRegisteredData(gpu_model="H100-80GB", gpus=8, gpu_memory_gib=80)
                await cli.publish(NodeRegistered(source="lanes/cli", node=f"n-{unique}", data=data))
                # The node and the job arrive on different streams, read by different consumers: a job the
                # scheduler decides before it has read the node is rejected (no node fits), not held.
                await eventually(
                    lambda: scheduler_knows(urls.database_url, f"n-{unique}"),
                    timeout_s=30,
                    what="the scheduler to know the node",
                )
                body = {"job_id": job, "spec": {"name": "least", "workers": 1, "gpus_per_worker": 2}}

                async def answered() -> bool:
                    # The job API answers once the lifecycle's runner subscribed.
                    with contextlib.suppress(Exception):
                        reply = await cli._nc.request("lanes.api.job.submit", json.dumps(body).encode(), timeout=2)
                        return bool(json.loads(reply.data)["ok"])
                    return False

                await eventually(answered, timeout_s=30, what="the job API to accept the submission")

            seen: dict[str, object] = {}

            async def placed_and_recorded() -> bool:
                placed = await last_on(secured_nats, f"lanes.job.{job}.placed")
                seen["submitted"] = await last_on(secured_nats, f"lanes.job.{job}.submitted")
                seen["placed"] = placed
                seen["state_changed"] = await last_on(secured_nats, f"lanes.job.{job}.state_changed")
                seen["ready"] = [getattr(runner, "ready", None) for _, runners in services for runner in runners]
                if placed is None or seen["state_changed"] is None:
                    return False
                conn = await asyncpg.connect(urls.database_url)
                try:
                    query = "SELECT count(*) FROM audit_links WHERE stream = $1 AND seq = $2"
                    return bool(await conn.fetchval(query, JOBS.name, placed))
                finally:
                    await conn.close()

            try:
                await eventually(
                    placed_and_recorded, timeout_s=60, what="the job placed, its state changed and audited"
                )
            except AssertionError as exc:
                refusals = {name: denied_operations(nc) for name, (nc, _) in zip(EACH_AS_ITSELF, services, strict=True)}
                logged = await everything_on(secured_nats)
                raise AssertionError(
                    f"{exc}; what the log and the services showed: {seen}; refused: {refusals}; the log: {logged}"
                ) from exc
        finally:
            stop.set()
            await asyncio.gather(*running, return_exceptions=True)
        refused = {name: denied_operations(nc) for name, (nc, _) in zip(EACH_AS_ITSELF, services, strict=True)}
    assert refused == {name: [] for name in EACH_AS_ITSELF}
