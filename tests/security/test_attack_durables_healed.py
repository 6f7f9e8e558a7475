"""Issue 34, item 1, as the admin (the one identity still allowed to): deleting `lifecycle-jobs` stopped new jobs
from appearing, and re-filtering `scheduler-jobs` left a job queued forever. The services now notice and
restore their durables (`lanes_runtime.upkeep`), with the rights of their own identities, and the jobs go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import pytest
from nats.aio.client import Client as NatsClient
from support.contract import stored
from support.waiting import eventually

from lanes_cli.bootstrap import SERVICES
from lanes_contract.client import LanesClient, connect_nats, denied_operations
from lanes_contract.events import NodeRegistered, NodeRegisteredData
from lanes_contract.streams import JOBS, NODES
from lanes_runtime import upkeep
from lanes_runtime.consumer import EventConsumer
from lanes_runtime.service import connected, prepare_services, run_consumers
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]

SERVING = ("scheduler", "lifecycle")


@pytest.fixture(autouse=True)
def quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked every half second: the same code path as every three, with a shorter wait."""
    monkeypatch.setattr(upkeep, "CHECK_EVERY_S", 0.5)


async def submit(cli: LanesClient, job: str) -> None:
    """Submit a job through the job API, as the CLI does (retried until the lifecycle's runner answers)."""
    body = {"job_id": job, "spec": {"name": "healed", "workers": 1, "gpus_per_worker": 1}}

    async def answered() -> bool:
        with contextlib.suppress(Exception):
            reply = await cli._nc.request("lanes.api.job.submit", json.dumps(body).encode(), timeout=2)
            return bool(json.loads(reply.data)["ok"])
        return False

    await eventually(answered, timeout_s=30, what=f"the job API to accept {job}")


async def placed_and_changed(admin: NatsClient, job: str) -> None:
    """Wait until the scheduler placed `job` and the lifecycle folded a state change of it."""

    stored_now: dict[str, int] = {}

    async def done() -> bool:
        for name in ("submitted", "placed", "state_changed"):
            stored_now[name] = await stored(admin.jetstream(), JOBS.name, f"lanes.job.{job}.{name}")
        return stored_now["placed"] > 0 and stored_now["state_changed"] > 0

    try:
        await eventually(done, timeout_s=60, what=f"{job} placed and its state changed")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; stored: {stored_now}") from exc


def spec_of(runners: list[EventConsumer], durable: str) -> EventConsumer:
    (consumer,) = (runner for runner in runners if runner.name == durable)
    return consumer


async def test_the_admin_deleting_and_re_filtering_the_services_durables_stops_no_job(
    secured_nats: EmbeddedNats, urls: ServerUrls, unique: str
) -> None:
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        services = []
        for name in SERVING:
            own = ServerUrls(
                nats_url=secured_nats.url_for(name), database_url=urls.database_url, redis_url=urls.redis_url
            )
            conns = await stack.enter_async_context(connected(own, name=name))
            services.append((conns.nc, await prepare_services(conns, [SERVICES[name]])))
        consumers = [runner for _, runners in services for runner in runners if isinstance(runner, EventConsumer)]
        scheduler = spec_of(consumers, "scheduler-jobs")
        running = [asyncio.create_task(run_consumers(runners, stop)) for _, runners in services]
        admin = await connect_nats(secured_nats.url, name="admin")
        stack.push_async_callback(admin.close)
        try:
            async with await LanesClient.connect(secured_nats.url_for("cli"), source="lanes/cli") as cli:
                data = NodeRegisteredData(gpu_model="H100-80GB", gpus=8, gpu_memory_gib=80)
                registered = await cli.publish(NodeRegistered(source="lanes/cli", node=f"n-{unique}", data=data))

                async def node_known() -> bool:  # a job submitted before would wait for capacity instead
                    info = await admin.jetstream().consumer_info(NODES.name, "scheduler-nodes")
                    return info.ack_floor is not None and info.ack_floor.stream_seq >= registered

                await eventually(node_known, what="the scheduler to know the node")
                await submit(cli, f"before-{unique}")
                await placed_and_changed(admin, f"before-{unique}")

                await admin.jetstream().delete_consumer(JOBS.name, "lifecycle-jobs")
                await submit(cli, f"deleted-{unique}")
                await placed_and_changed(admin, f"deleted-{unique}")

                bent = dataclasses.replace(scheduler.spec.config(), filter_subjects=["lanes.job.nobody.nothing"])
                await admin.jetstream().add_consumer(JOBS.name, config=bent)
                await submit(cli, f"refiltered-{unique}")
                await placed_and_changed(admin, f"refiltered-{unique}")
            restored = await admin.jetstream().consumer_info(JOBS.name, "scheduler-jobs")
            assert sorted(restored.config.filter_subjects or []) == sorted(scheduler.spec.subjects)
            await admin.jetstream().consumer_info(JOBS.name, "lifecycle-jobs")  # there again (raises if not)
        finally:
            stop.set()
            await asyncio.gather(*running, return_exceptions=True)
        refused = {name: denied_operations(nc) for name, (nc, _) in zip(SERVING, services, strict=True)}
    assert refused == {name: [] for name in SERVING}
