"""The Slurm adapter against a real Slurm (munged, slurmctld, slurmd started here) and real Lanes services.

Each job case appears on the Lanes timeline with its states, attempts, wait reasons and lanes, and `lanes
poc` judges it. `.ci/run` installs Slurm from Debian's packages, so these run in CI; they skip only where
Slurm truly cannot run (not installed, or not root: slurmd starts jobs as their user).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cli import LANES, local_stack, run_lanes_async
from support.observe import OBSERVE_SERVICES, in_state, job_view, poc_verdicts, timeline_events
from support.optional import SLURM, require
from support.waiting import eventually

from lanes_contract.codec import decode
from lanes_contract.events import JobWaiting, Lane, NodeStateChanged
from lanes_contract.topology import NodeState
from lanes_observe.outbox import Outbox, Sender
from lanes_observe.slurm import SlurmWatch
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls
from lanes_sandbox import slurm

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]

require(SLURM)

NODE = "slurm-n1"
LIFECYCLE = "job orchestration and lifecycle"
_TASK = """
import os, sys
if os.environ["SLURM_PROCID"] == "1":
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
"""


@pytest.fixture
def cluster() -> Iterator[slurm.SlurmCluster]:
    with slurm.SlurmCluster(node_name=NODE, cpus=2) as running:
        yield running


@pytest.fixture
async def stack(own_urls: ServerUrls, cluster: slurm.SlurmCluster, tmp_path: Path) -> AsyncIterator[Connections]:
    """The services, and the Slurm adapter polling the cluster every 0.3 s."""
    async with local_stack(own_urls, OBSERVE_SERVICES, nodes=False) as conns:
        outbox = Outbox(tmp_path / "slurm-outbox.ndjson")
        watch = SlurmWatch(outbox, Sender(outbox, own_urls.nats_url, name="tests-slurm"), env=cluster.env)
        stop = asyncio.Event()
        polling = asyncio.create_task(watch.run(stop, 0.3))
        try:
            yield conns
        finally:
            stop.set()
            await polling
            await watch.sender.close()


def _script(cluster: slurm.SlurmCluster, name: str, body: str) -> str:
    path = cluster.directory / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return str(path)


async def _sbatch(cluster: slurm.SlurmCluster, *args: str) -> int:
    """Submit a batch job (Slurm's clients block: off the event loop, where the services run)."""
    return await asyncio.to_thread(cluster.sbatch, "--chdir", str(cluster.directory), *args)


async def _slurm(cluster: slurm.SlurmCluster, *command: str) -> None:
    await asyncio.to_thread(cluster.run, *command)


def _lanes_id(slurm_id: int) -> str:
    return f"slurm-lanes-{slurm_id}"


async def _released(urls: ServerUrls, job_id: str) -> dict[str, Any]:
    await eventually(lambda: in_state(urls, job_id, "released"), what=f"{job_id} released", timeout_s=90)
    view = await job_view(urls, job_id)
    assert view is not None
    return view


def _ranks(attempt: dict[str, Any]) -> list[tuple[int, str, int | None, int | None]]:
    ranks = sorted(attempt["ranks"].values(), key=lambda r: r["rank"])
    return [(r["rank"], r["node"], r["exit_code"], r["signal"]) for r in ranks]


async def test_a_job_that_succeeds(stack: Connections, own_urls: ServerUrls, cluster: slurm.SlurmCluster) -> None:
    job_id = _lanes_id(await _sbatch(cluster, "-n2", _script(cluster, "ok.sh", "srun true")))
    view = await _released(own_urls, job_id)
    assert view["spec"]["managed_by"] == "slurm"
    assert [(a["number"], a["cause"]) for a in view["attempts"]] == [(1, "normal_completion")]
    assert _ranks(view["attempts"][0]) == [(0, NODE, 0, None), (1, NODE, 0, None)]
    assert (await poc_verdicts(own_urls, job_id))[LIFECYCLE] == "passed"


async def test_a_job_that_fails_on_one_task(
    stack: Connections, own_urls: ServerUrls, cluster: slurm.SlurmCluster
) -> None:
    # `lanes run` wraps srun inside the job: srun names the failed task, so Lanes knows which rank failed.
    task = cluster.directory / "task.py"
    task.write_text(_TASK)
    script = _script(cluster, "fail.sh", f"{LANES} run -- srun -n2 {sys.executable} {task}")
    exported = f"--export=ALL,NATS_URL={own_urls.nats_url}"
    slurm_id = await _sbatch(cluster, "-n2", exported, script)
    job_id = _lanes_id(slurm_id)
    ended = await asyncio.to_thread(cluster.wait_job, slurm_id, {"FAILED", "COMPLETED"})
    assert ended["job_state"] == "FAILED"  # srun's status, through
    view = await _released(own_urls, job_id)
    (attempt,) = view["attempts"]
    assert _ranks(attempt) == [(0, NODE, 0, None), (1, NODE, 1, None)]
    assert "rank 1" in (attempt["exit_detail"] or attempt["cause_detail"])

    async def judged() -> bool:
        verdicts = await poc_verdicts(own_urls, job_id)
        return verdicts[LIFECYCLE] == verdicts["communication observability"] == "passed"

    await eventually(judged, what="poc passes lifecycle and first-error finding", timeout_s=60)
    refined = await job_view(own_urls, job_id)
    assert refined is not None
    assert "CUDA error" in refined["attempts"][0]["cause_detail"]


async def test_a_requeued_job_has_two_attempts(
    stack: Connections, own_urls: ServerUrls, cluster: slurm.SlurmCluster
) -> None:
    gate = cluster.directory / "go"
    script = _script(cluster, "requeue.sh", f"while [ ! -e {gate}-$SLURM_RESTART_COUNT ]; do sleep 0.1; done")
    slurm_id = await _sbatch(cluster, "--requeue", script)
    job_id = _lanes_id(slurm_id)
    await eventually(lambda: in_state(own_urls, job_id, "starting"), what="attempt 1 running", timeout_s=90)
    await _slurm(cluster, "scontrol", "requeue", str(slurm_id))
    # Slurm starts it again once attempt 1's job credential has expired (5 s in the sandbox's slurm.conf).

    async def second_attempt_runs() -> bool:
        view = await job_view(own_urls, job_id)
        return view is not None and len(view["attempts"]) == 2 and view["state"] == "starting"

    await eventually(second_attempt_runs, what="attempt 2 running", timeout_s=90)
    await asyncio.to_thread(Path(f"{gate}-1").touch)
    view = await _released(own_urls, job_id)
    first, second = view["attempts"]
    assert (first["number"], first["cause"]) == (1, "platform_action")  # stopped by the requeue (SIGTERM)
    assert _ranks(first) == [(0, NODE, None, 15)]
    assert (second["number"], second["cause"]) == (2, "normal_completion")
    assert (await poc_verdicts(own_urls, job_id))[LIFECYCLE] == "passed"


async def test_a_job_pending_for_resources_then_running(
    stack: Connections, own_urls: ServerUrls, cluster: slurm.SlurmCluster
) -> None:
    gate = cluster.directory / "free"
    holder = _lanes_id(
        await _sbatch(cluster, "-n2", _script(cluster, "hold.sh", f"while [ ! -e {gate} ]; do sleep 0.1; done"))
    )
    waiter = _lanes_id(await _sbatch(cluster, "-n1", _script(cluster, "wait.sh", "true")))

    async def waits_for_capacity() -> bool:
        view = await job_view(own_urls, waiter)
        return view is not None and view["wait_reason"] == "capacity_short"

    await eventually(waits_for_capacity, what=f"{waiter} waiting for capacity", timeout_s=90)
    await asyncio.to_thread(gate.touch)
    view = await _released(own_urls, waiter)
    assert [span["state"] for span in view["history"]][:3] == ["queued", "admitted", "starting"]
    waits = [e for e in await timeline_events(stack, waiter) if isinstance(e, JobWaiting)]
    assert waits
    assert waits[-1].data.reason == "capacity_short"
    assert waits[-1].data.detail == "Slurm: Resources"
    assert waits[-1].data.blocking[0].reason == "Resources"  # Slurm's own code, kept
    assert view["attempts"][0]["cause"] == "normal_completion"
    await _released(own_urls, holder)
    assert (await poc_verdicts(own_urls, waiter))[LIFECYCLE] == "passed"


async def test_a_drained_node_is_a_host_lane_event_and_topology_agrees(
    stack: Connections, own_urls: ServerUrls, cluster: slurm.SlurmCluster, tmp_path: Path
) -> None:
    topology = tmp_path / "topology.conf"
    topology.write_text(f"SwitchName=leaf-1 Nodes={NODE}\n")
    imported = await run_lanes_async(own_urls, "topology", "import", "--format", "slurm", "--gpus", "1", str(topology))
    assert imported.returncode == 0, imported.stderr
    await _slurm(cluster, "scontrol", "update", f"nodename={NODE}", "state=drain", "reason=xid 79 on GPU 0")
    job_id = _lanes_id(await _sbatch(cluster, "-w", NODE, _script(cluster, "pinned.sh", "true")))

    async def node_events() -> list[NodeStateChanged]:
        selection = Selection(stream="LANES_NODES", subject=f"lanes.node.{NODE}.>")
        found = [decode(m.subject, m.headers, m.data) async for m in iter_stream(stack.nc.jetstream(), selection)]
        return [e for e in found if isinstance(e, NodeStateChanged)]

    async def drained() -> bool:
        return any(e.data.state is NodeState.DRAINING for e in await node_events())

    await eventually(drained, what="the drain on the node's timeline", timeout_s=60)
    drain = next(e for e in await node_events() if e.data.state is NodeState.DRAINING)
    assert (drain.lane, drain.data.reason) == (Lane.HOST, "Slurm: xid 79 on GPU 0")

    async def topology_says_draining() -> bool:
        shown = await run_lanes_async(own_urls, "topology", "show", "--json")
        nodes = {n["node_id"]: n for n in json.loads(shown.stdout)["nodes"]} if shown.returncode == 0 else {}
        return bool(nodes.get(NODE, {}).get("state") == "draining")

    await eventually(topology_says_draining, what="lanes topology show agrees", timeout_s=60)

    async def isolated() -> bool:
        view = await job_view(own_urls, job_id)
        return view is not None and view["wait_reason"] == "isolated"

    await eventually(isolated, what=f"{job_id} waiting on the drained node", timeout_s=60)
    await _slurm(cluster, "scontrol", "update", f"nodename={NODE}", "state=resume")
    view = await _released(own_urls, job_id)
    assert view["attempts"][0]["cause"] == "normal_completion"
    assert (await poc_verdicts(own_urls, job_id))[LIFECYCLE] == "passed"


async def test_lanes_slurm_watch_once_publishes_what_slurm_shows(
    own_urls: ServerUrls, cluster: slurm.SlurmCluster, tmp_path: Path
) -> None:
    slurm_id = await _sbatch(cluster, "-n2", _script(cluster, "once.sh", "true"))
    await asyncio.to_thread(cluster.wait_job, slurm_id, {"COMPLETED"})
    outbox = tmp_path / "outbox.ndjson"
    ran = await run_lanes_async(
        own_urls, "slurm", "watch", "--once", "--outbox", str(outbox), env={"SLURM_CONF": cluster.env["SLURM_CONF"]}
    )
    assert ran.returncode == 0, ran.stderr
    assert not outbox.exists()  # everything was published
    async with local_stack(own_urls, [], nodes=False) as conns:
        kinds = [type(e).__name__ for e in await timeline_events(conns, _lanes_id(slurm_id))]
    assert kinds == [
        "JobSubmitted",
        "JobPlaced",
        "RankStarted",
        "RankStarted",
        "RankExited",
        "RankExited",
        "ResourcesReleased",
    ]
