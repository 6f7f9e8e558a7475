"""Topology scenario for `lanes demo`: a gang waits because free GPUs are split across leaves, then runs.

Four small nodes of 2 GPUs in their own pool (`topology-demo`): three under leaf `topo-leaf-a`, one under
`topo-leaf-b`. A first job (2 workers x 2 GPUs) takes two nodes of leaf a. A second one needs 4 GPUs under
one leaf: 4 GPUs are free, but 2 per leaf, so it waits with `topology_unsatisfiable`, naming leaf a and
the job that holds it. When the first job ends the scheduler releases its leaf, places the second job
there and closes its wait reason; the wait history (reason, blocking resources, owner lane, seconds) is
read back from the scheduler's projection.

The scenario needs a stack that is up (services consuming); it registers its own nodes and runs its own
LocalLauncher for them, so it does not depend on the demo's other nodes or jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from lanes_agent.launcher import LocalLauncher
from lanes_agent.rank_output import READY_MARKER
from lanes_cli.scheduling import nodes_known, scheduling_view
from lanes_contract.client import LanesClient
from lanes_contract.codec import decode
from lanes_contract.errors import DecodeError
from lanes_contract.events import (
    JobStateChanged,
    JobSubmitted,
    JobSubmittedData,
    JobWaiting,
    NodeRegistered,
    NodeRegisteredData,
)
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import JobSpec, JobState
from lanes_contract.topology import Level, TopologyConstraint
from lanes_runtime.service import Connections

SOURCE = "lanes/demo"
POOL = "topology-demo"
TOPOLOGY_NODES = {
    "topo-a1": "topo-leaf-a",
    "topo-a2": "topo-leaf-a",
    "topo-a3": "topo-leaf-a",
    "topo-b1": "topo-leaf-b",
}
GPUS_PER_NODE = 2
# Ranks get ready, hold their GPUs for a moment (long enough to see the second job wait), then succeed.
_HOLD_THEN_SUCCEED = f"import time\nprint({READY_MARKER!r}, flush=True)\ntime.sleep(1.5)\n"


@dataclass(frozen=True)
class TopologyDemo:
    """The two jobs of the scenario and the second one's wait history."""

    blocker_job_id: str
    job_id: str
    wait_history: list[dict[str, Any]] = field(default_factory=list)


class _Watch:
    """State changes and wait reasons of one job, subscribed to before it is submitted."""

    def __init__(self) -> None:
        self.states: list[JobState] = []
        self.reasons: list[str] = []
        self._changed = asyncio.Condition()

    async def on_message(self, msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            event = decode(msg.subject, msg.headers, msg.data)
            async with self._changed:
                if isinstance(event, JobStateChanged):
                    self.states.append(event.data.to_state)
                elif isinstance(event, JobWaiting):
                    self.reasons.append(event.data.reason)
                self._changed.notify_all()

    async def until(self, timeout_s: float, *, state: JobState | None = None, reason: str | None = None) -> None:
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: state in self.states or reason in self.reasons)


async def _submit(conns: Connections, job_id: str, spec: JobSpec) -> _Watch:
    watch = _Watch()
    await conns.nc.subscribe(f"lanes.job.{job_id}.*", cb=watch.on_message)
    await LanesClient(conns.nc, SOURCE).publish(
        JobSubmitted(source=SOURCE, jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))
    )
    return watch


async def register_topology_nodes(client: LanesClient) -> None:
    """Announce the scenario's nodes with their leaves (ids derive from the content: re-running is harmless)."""
    for node, leaf in TOPOLOGY_NODES.items():
        data = NodeRegisteredData(
            gpu_model="H100-80GB", gpus=GPUS_PER_NODE, gpu_memory_gib=80, leaf=leaf, spine="topo-spine", pool=POOL
        )
        await client.publish(NodeRegistered(id=f"register-{node}-{leaf}-{POOL}", source=SOURCE, node=node, data=data))


async def _nodes_known(conns: Connections, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s), conns.pool.acquire() as conn:
        # The scheduler's projection is the honest check that it has seen the nodes before any job arrives.
        while await nodes_known(conn, TOPOLOGY_NODES) < len(TOPOLOGY_NODES):  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def topology_wait_then_placed(conns: Connections, *, timeout_s: float = 90.0) -> TopologyDemo:
    """Run the scenario; return both job ids and the second job's wait history once it is released."""
    suffix = new_event_id()[-12:]
    blocker_id, job_id = f"demo-topo-hold-{suffix}", f"demo-topo-wait-{suffix}"
    stop = asyncio.Event()
    launcher = LocalLauncher(conns.nc, frozenset(TOPOLOGY_NODES), durable=f"launcher-topology-{suffix}")
    launcher_task = asyncio.create_task(launcher.run(stop), name="topology-launcher")
    try:
        await register_topology_nodes(LanesClient(conns.nc, SOURCE))
        await _nodes_known(conns, timeout_s)
        command = (sys.executable, "-c", _HOLD_THEN_SUCCEED)
        blocker = await _submit(
            conns,
            blocker_id,
            JobSpec(name="demo-topo-hold", workers=2, gpus_per_worker=2, pool=POOL, command=command),
        )
        await blocker.until(timeout_s, state=JobState.ADMITTED)
        waiting = await _submit(
            conns,
            job_id,
            JobSpec(
                name="demo-topo-wait",
                workers=2,
                gpus_per_worker=2,
                pool=POOL,
                command=command,
                topology=TopologyConstraint(required=Level.LEAF),
            ),
        )
        await waiting.until(timeout_s, reason="topology_unsatisfiable")
        await waiting.until(timeout_s, state=JobState.RELEASED)
        await blocker.until(timeout_s, state=JobState.RELEASED)
    finally:
        stop.set()
        await asyncio.gather(launcher_task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await conns.nc.jetstream().delete_consumer("LANES_JOBS", f"launcher-topology-{suffix}")
    async with conns.pool.acquire() as conn:
        view = await scheduling_view(conn, job_id)
    return TopologyDemo(blocker_id, job_id, view.get("wait_history", []))
