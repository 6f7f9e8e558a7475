"""`lanes demo`: all five services on one event loop, a 2-node x 4-GPU job run to the end, read back."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from nats.aio.msg import Msg

from lanes_common.bus import LanesClient
from lanes_common.codec import decode
from lanes_common.errors import DecodeError
from lanes_common.events import JobStateChanged, JobSubmitted, JobSubmittedData, NodeRegistered, NodeRegisteredData
from lanes_common.ids import new_event_id
from lanes_common.jobs import JobSpec, JobState, WorkloadClass
from lanes_common.settings import ServerUrls
from lanes_lifecycle.adapters import repository as lifecycle_jobs
from lanes_ops.bootstrap import SERVICES, Connections, connected, prepare_services, run_consumers
from lanes_ops.launcher import LocalLauncher
from lanes_ops.timeline import TimelineEntry, job_timeline

DEMO_NODES = {"node-1": 4, "node-2": 4}
SOURCE = "lanes/demo"


def local_nodes(count: int, gpus: int) -> dict[str, int]:
    """Names and GPU counts of simulated local nodes."""
    return {f"node-{i}": gpus for i in range(1, count + 1)}


async def register_nodes(client: LanesClient, nodes: dict[str, int]) -> None:
    """Announce simulated nodes to the scheduler (ids derive from the name, so re-running is harmless)."""
    for node, gpus in nodes.items():
        data = NodeRegisteredData(gpu_model="H100-80GB", gpus=gpus, gpu_memory_gib=80, labels={"rack": "r1"})
        await client.publish(NodeRegistered(id=f"register-{node}-{gpus}", source=SOURCE, node=node, data=data))


async def wait_for_state(conns: Connections, job_id: str, state: JobState) -> asyncio.Future[None]:
    """A future that completes when the job reaches `state` (subscribed before anything is published)."""
    reached: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_change(msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            event = decode(msg.subject, msg.headers, msg.data)
            if isinstance(event, JobStateChanged) and event.data.to_state is state and not reached.done():
                reached.set_result(None)

    await conns.nc.subscribe(f"lanes.job.{job_id}.state_changed", cb=on_change)
    return reached


async def wait_for_nodes(conns: Connections, count: int, timeout_s: float) -> None:
    """Wait until the scheduler's projection holds at least `count` nodes."""
    async with asyncio.timeout(timeout_s):
        # Polling the scheduler's projection is the simplest honest check that it has seen the nodes.
        while await conns.pool.fetchval("SELECT count(*) FROM scheduler_nodes") < count:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def job_report(conns: Connections, job_id: str, entries: list[TimelineEntry]) -> dict[str, Any]:
    """The job as `lanes demo --json` and `lanes job --json` print it."""
    async with conns.pool.acquire() as conn:
        view = await lifecycle_jobs.load(conn, job_id)
    return {
        "job_id": job_id,
        "state": view.state.value if view else None,
        "attempts": [a.model_dump(mode="json") for a in view.attempts] if view else [],
        "timeline": [entry.as_json() for entry in entries],
    }


async def run_demo(urls: ServerUrls, *, timeout_s: float = 120.0) -> tuple[dict[str, Any], list[TimelineEntry]]:
    """Run the scripted scenario and return the job's report and its timeline read back from JetStream."""
    job_id = f"demo-{new_event_id()[-12:]}"
    async with connected(urls, name="lanes-demo") as conns:
        stop = asyncio.Event()
        consumers = await prepare_services(conns, SERVICES)
        workers = [
            asyncio.create_task(run_consumers(consumers, stop), name="services"),
            asyncio.create_task(LocalLauncher(conns.nc, frozenset(DEMO_NODES)).run(stop), name="launcher"),
        ]
        try:
            released = await wait_for_state(conns, job_id, JobState.RELEASED)
            client = LanesClient(conns.nc, SOURCE)
            await register_nodes(client, DEMO_NODES)
            # Submit once the scheduler knows the nodes, so the scenario does not depend on which of its two
            # consumers runs first (a job submitted earlier would wait with spec_mismatch, then be placed).
            await wait_for_nodes(conns, len(DEMO_NODES), timeout_s)
            spec = JobSpec(name="demo-train", workload_class=WorkloadClass.TRAINING, workers=2, gpus_per_worker=4)
            await client.publish(JobSubmitted(source=SOURCE, jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
            done, _ = await asyncio.wait([released, *workers], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if released not in done:
                failed = [t for t in workers if t in done]
                if failed:
                    failed[0].result()  # raises the service's error
                msg = f"job {job_id} did not finish within {timeout_s:.0f}s"
                raise TimeoutError(msg)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
        entries = await job_timeline(conns.nc.jetstream(), job_id)
        return await job_report(conns, job_id, entries), entries
