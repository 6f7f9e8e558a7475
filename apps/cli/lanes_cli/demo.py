"""`lanes demo`: every service on one event loop, a scripted multi-node scenario with faults, read back.

The scenario, on four simulated nodes of 4 GPUs (each rank a real process): a 2-node x 4-GPU training job
that succeeds; an evaluation cancelled while starting; a job whose one rank exits non-zero (partially
failed, then failed); a 4-node job whose last rank is OOM-killed while the others time out in an
all-reduce (telemetry elects the first error); and a gang that waits for topology until another job
releases its leaf. Every job's timeline is read back from JetStream, followed by the finding, the wait
history and the POC scorecard computed from those timelines.

Two options make the nodes more real, and the demo says which paths its faults took (`FaultPaths`):
`--netns` puts each node's ranks in a network namespace of its own (the router reaches the replicas across
the bridge), and `--kernel` lets the kernel do the OOM kill in a rank's memory cgroup and carries the Xid
line through /dev/kmsg. Both need root, and neither is the default: a demo must not touch the host's
network or write GPU errors into its kernel log unasked.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from lanes_agent.faults import KMSG
from lanes_agent.launcher import LocalLauncher
from lanes_agent.netns import NodeNetworks
from lanes_cli.bootstrap import SERVICES, prepare_services
from lanes_cli.incident import bundle
from lanes_cli.poc import CapabilityResult, scorecard
from lanes_cli.replay import Pace, merged, write_ndjson
from lanes_cli.scenarios.inference import InferenceDemo, replica_node_fails
from lanes_cli.scenarios.lifecycle import cancelled_while_starting, one_rank_fails
from lanes_cli.scenarios.telemetry import OOM_LIMIT_GIB, oom_killed_rank
from lanes_cli.scenarios.topology import topology_wait_then_placed
from lanes_cli.scheduling import nodes_known, scheduling_view
from lanes_cli.timeline import TimelineEntry, job_timeline, read_stream
from lanes_cli.verdicts import DecisionVerdict, decision_verdicts
from lanes_contract.client import LanesClient
from lanes_contract.codec import decode
from lanes_contract.errors import DecodeError
from lanes_contract.events import JobStateChanged, JobSubmitted, JobSubmittedData, NodeRegistered, NodeRegisteredData
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import JobSpec, JobState, WorkloadClass
from lanes_contract.streams import JOBS, REQUESTS
from lanes_lifecycle import views as lifecycle_jobs
from lanes_router.entrypoints.runner import RouterRunner
from lanes_runtime.reader import Selection, count
from lanes_runtime.service import Connections, connected, run_consumers
from lanes_runtime.settings import ServerUrls, configured_keyring

SOURCE = "lanes/demo"
_T = TypeVar("_T")


def local_nodes(count: int, gpus: int) -> dict[str, int]:
    """Names and GPU counts of simulated local nodes."""
    return {f"node-{i}": gpus for i in range(1, count + 1)}


DEMO_NODES = local_nodes(4, 4)


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
    async with asyncio.timeout(timeout_s), conns.pool.acquire() as conn:
        # Polling the scheduler's projection is the simplest honest check that it has seen the nodes.
        while await nodes_known(conn) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def job_report(conns: Connections, job_id: str, entries: list[TimelineEntry]) -> dict[str, Any]:
    """The job as `lanes demo --json` prints it: lifecycle view, scheduling (wait history) and timeline."""
    async with conns.pool.acquire() as conn:
        view = await lifecycle_jobs.load(conn, job_id)
        scheduling = await scheduling_view(conn, job_id)
    return {
        "job_id": job_id,
        "state": view.state.value if view else None,
        "attempts": [a.model_dump(mode="json") for a in view.attempts] if view else [],
        "scheduling": scheduling,
        "timeline": [entry.as_json() for entry in entries],
    }


@dataclass(frozen=True)
class FaultPaths:
    """Which paths the demo's nodes and faults took: real links and the kernel's, or played ones."""

    networks: NodeNetworks | None = None
    through_kernel: bool = False

    def described(self) -> dict[str, str]:
        """One line each for the links, the OOM kill and the Xid."""
        if self.networks is None:
            links = "the nodes share this host's network"
        else:
            addresses = ", ".join(f"{link.node}={link.address}" for link in self.networks.links.values())
            links = f"each node in its own network namespace on bridge {self.networks.bridge} ({addresses})"
        if self.through_kernel:
            limit = f"{OOM_LIMIT_GIB * 1024:.0f} MiB"
            oom = f"the kernel's OOM killer, in the rank's {limit} memory cgroup; its line read from /dev/kmsg"
            xid = "written to /dev/kmsg and read back by the node agent"
        else:
            oom = "played: the rank kills itself with SIGKILL and the scenario publishes the kernel's line"
            xid = "played: the scenario publishes the line the node agent would have read"
        return {"links": links, "oom_kill": oom, "xid": xid}


@dataclass(frozen=True, kw_only=True)
class DemoRun:
    """What the demo shows: each job with its timeline, the OOM job's finding, the scorecard."""

    jobs: list[dict[str, Any]]
    entries: dict[str, list[TimelineEntry]]
    oom_job_id: str
    topology_job_id: str
    scorecard: list[CapabilityResult]
    manual_job_id: str
    inference: InferenceDemo
    requests: list[dict[str, Any]]
    """Every inference request's provenance row (`lanes.req.>`)."""
    paths: FaultPaths = FaultPaths()

    def job(self, job_id: str) -> dict[str, Any]:
        """One job's report."""
        return next(job for job in self.jobs if job["job_id"] == job_id)

    def off_script(self) -> list[str]:
        """Jobs that did not end as their story says: the failing one waits for its owner, the rest released."""
        expected = {job["job_id"]: JobState.RELEASED.value for job in self.jobs}
        expected[self.manual_job_id] = JobState.AWAITING_MANUAL.value
        return [
            f"{job['job_id']} ended {job['state']}, not {expected[job['job_id']]}"
            for job in self.jobs
            if job["state"] != expected[job["job_id"]]
        ]

    def verdicts(self) -> list[DecisionVerdict]:
        """Every decision in force against its attempt's final settled finding."""
        return decision_verdicts(row for job in self.jobs for row in job["timeline"])

    def wrong_decisions(self) -> list[str]:
        """Decisions whose culprit is not their attempt's final settled finding's: the demo fails on any."""
        return [verdict.explain() for verdict in self.verdicts() if not verdict.agrees]

    def incident(self) -> dict[str, Any]:
        """The fault bundle of the OOM-killed job."""
        return bundle(self.job(self.oom_job_id))

    def replica_incident(self) -> dict[str, Any]:
        """The fault bundle of the replica whose node failed, with the requests the fault touched."""
        return bundle(self.job(self.inference.replica_job_ids[0]), self.requests)

    def as_json(self) -> dict[str, Any]:
        """`lanes demo --json`."""
        return {
            "jobs": self.jobs,
            "incident": self.incident(),
            "manual": bundle(self.job(self.manual_job_id))["decision_chain"],
            "inference": {
                "replicas": list(self.inference.replica_job_ids),
                "failed_node": self.inference.failed_node,
                "clients": self.inference.clients,
                "incident": self.replica_incident(),
            },
            "poc": [result.as_json() for result in self.scorecard],
            "fault_paths": self.paths.described(),
        }


async def _run_job(conns: Connections, client: LanesClient, spec: JobSpec, timeout_s: float) -> str:
    job_id = f"demo-{new_event_id()[-12:]}"
    released = await wait_for_state(conns, job_id, JobState.RELEASED)
    await client.publish(JobSubmitted(source=SOURCE, jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
    await asyncio.wait_for(released, timeout_s)
    return job_id


async def guarded(work: Coroutine[Any, Any, _T], workers: list[asyncio.Task[None]], timeout_s: float) -> _T:
    """Await `work`, but raise at once if a service or the launcher failed meanwhile (the demo and `lanes poc run`)."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait([task, *workers], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    for worker in workers:
        if worker in done:
            worker.result()  # raises the service's error
    msg = f"the demo scenario did not finish within {timeout_s:.0f}s"
    raise TimeoutError(msg)


async def export_jobs(js: JetStreamContext, path: Path) -> int:
    """Write the job stream as `lanes replay` prints it (so `lanes whatif --from` reads it); return the count."""
    everything = Selection(JOBS.name, ">")
    total = await count(js, everything)
    with path.open("wb") as handle:
        return await write_ndjson(merged(js, [everything]), handle, Pace("instant"), total)


async def run_demo(
    urls: ServerUrls,
    *,
    timeout_s: float = 120.0,
    kernel_delay_s: float = 0.0,
    paths: FaultPaths | None = None,
    export: Path | None = None,
) -> DemoRun:
    """Run the scripted scenario and return every job's report and timeline, read back from JetStream.

    `paths`: each node's namespace (made by the caller) and whether faults go through the kernel. `export`:
    a file to write the job stream to once the scenario ran (the input of `lanes whatif recovery --from`).
    """
    paths = paths or FaultPaths()
    kernel = paths.through_kernel
    async with connected(urls, name="lanes-demo") as conns:
        stop = asyncio.Event()
        consumers = await prepare_services(conns, SERVICES)
        router = next(consumer for consumer in consumers if isinstance(consumer, RouterRunner))
        launcher = LocalLauncher(
            conns.nc, frozenset(DEMO_NODES), kernel_log=KMSG if kernel else None, networks=paths.networks
        )
        workers = [
            asyncio.create_task(run_consumers(consumers, stop), name="services"),
            asyncio.create_task(launcher.run(stop), name="launcher"),
        ]
        try:
            client = LanesClient(conns.nc, SOURCE)
            await register_nodes(client, DEMO_NODES)
            # Submit once the scheduler knows the nodes, so the scenario does not depend on which of its two
            # consumers runs first (a job submitted earlier would wait with spec_mismatch, then be placed).
            await guarded(wait_for_nodes(conns, len(DEMO_NODES), timeout_s), workers, timeout_s)
            train = JobSpec(name="demo-train", workload_class=WorkloadClass.TRAINING, workers=2, gpus_per_worker=4)
            trained = await guarded(_run_job(conns, client, train, timeout_s), workers, timeout_s)
            cancelled = await guarded(cancelled_while_starting(conns, timeout_s=timeout_s), workers, timeout_s)
            manual_job_id = await guarded(one_rank_fails(conns, timeout_s=timeout_s), workers, timeout_s)
            oom_job_id = await guarded(
                oom_killed_rank(conns, timeout_s=timeout_s, kernel_delay_s=kernel_delay_s, through_kernel=kernel),
                workers,
                timeout_s,
            )
            job_ids = [trained, cancelled, manual_job_id, oom_job_id]
            topology = await guarded(topology_wait_then_placed(conns, timeout_s=timeout_s), workers, timeout_s)
            job_ids += [topology.blocker_job_id, topology.job_id]
            router_url = await guarded(router.url(), workers, timeout_s)
            inference = await guarded(
                replica_node_fails(conns, router_url, timeout_s=timeout_s, through_kernel=kernel), workers, timeout_s
            )
            job_ids += list(inference.replica_job_ids)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
        js = conns.nc.jetstream()
        if export is not None:
            await export_jobs(js, export)
        keyring = configured_keyring()  # the embedded server's: each event's signer is shown checked
        entries = {job_id: await job_timeline(js, job_id, keyring) for job_id in job_ids}
        jobs = [await job_report(conns, job_id, entries[job_id]) for job_id in job_ids]
        requests = [entry.as_json() for entry in await read_stream(js, Selection(REQUESTS.name, "lanes.req.>"))]
        rows = [row for job in jobs for row in job["timeline"]]
        return DemoRun(
            jobs=jobs,
            entries=entries,
            oom_job_id=oom_job_id,
            topology_job_id=topology.job_id,
            scorecard=scorecard(rows, requests),
            manual_job_id=manual_job_id,
            inference=inference,
            requests=requests,
            paths=paths,
        )
