"""`lanes drill` on a real 4-rank torch.distributed (gloo) training job: one real fault per test.

Scheduler, lifecycle, telemetry and recovery run in this process against the test's own NATS and database,
with a node agent for five simulated nodes of four GPUs (so a rank fills a node, the job spans four, and a
cordoned node leaves room to resume). The agent follows the real kernel log. Each rank is the shipped drill
workload (`lanes_agent.drill_workload`): it all-reduces every step and rank 0 checkpoints.

Where the test runs as root, each node's ranks run in a network namespace of their own, joined by a bridge,
so the gang's traffic crosses real links and `link-down` cuts one.

For each kind the drill must end named right (the settled finding names the injected rank, its node and the
lane that owns the fault) and recovery must do what the default policy says for that lane: resume from the
checkpoint on the other nodes for a host fault, wait for the model's owner for an exception.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support.cli import local_stack, run_lanes_async
from support.optional import KERNEL, TORCH, require
from support.recovery import register_nodes, spec, wait_for
from support.waiting import eventually

from lanes_agent.launcher import LocalLauncher
from lanes_agent.netns import NodeNetworks, link_of
from lanes_cli.drills import STRAGGLER_DURATION_S, STRAGGLER_READY_STEP
from lanes_cli.timeline import job_timeline
from lanes_contract.client import LanesClient
from lanes_contract.events import (
    CheckpointSaved,
    DrillKind,
    JobSubmitted,
    JobSubmittedData,
    RecoveryAction,
    RecoveryDecided,
)
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]

require(TORCH)

KMSG = Path("/dev/kmsg")
NODES = [f"drill-{i}" for i in range(1, 6)]
DRILLED_RANK = 2
_NO_KMSG = None if os.access(KMSG, os.R_OK | os.W_OK) else "needs a readable, writable /dev/kmsg (root)"
_NO_NETNS = NodeNetworks.unavailable()


@pytest.fixture
async def stack(own_urls: ServerUrls, tmp_path: Path) -> AsyncIterator[Connections]:
    networks = None if _NO_NETNS else NodeNetworks(NODES)
    if networks is not None:
        networks.up()  # each node's ranks in a namespace of its own: gloo crosses real links
    async with local_stack(own_urls, ["scheduler", "lifecycle", "telemetry", "recovery"], nodes=False) as conns:
        stop = asyncio.Event()
        agent = LocalLauncher(
            conns.nc,
            frozenset(NODES),
            durable="agent-drills",
            stop_grace_s=2.0,
            kernel_log=None if _NO_KMSG else KMSG,
            kernel_log_position=tmp_path / "kmsg.position",
            state_dir=tmp_path / "ledger",
            networks=networks,
        )
        running = asyncio.create_task(agent.run(stop))
        try:
            await register_nodes(conns, LanesClient(conns.nc, "tests"), NODES)
            yield conns
        finally:
            stop.set()
            await running
            if networks is not None:
                networks.down()


async def _checkpointed(conns: Connections, job_id: str) -> bool:
    timeline = await job_timeline(conns.nc.jetstream(), job_id)
    return any(isinstance(entry.event, CheckpointSaved) for entry in timeline)


@pytest.mark.parametrize(
    ("kind", "lane", "action", "kernel"),
    [
        ("kill", "host", "resume", False),
        ("hang", "host", "resume", False),
        ("oom", "host", "resume", True),
        ("xid", "host", "resume", True),
        ("exception", "algorithm", "manual", False),
        ("link-down", "network", "resume", True),
    ],
)
async def test_a_drilled_fault_is_localised_to_its_rank_node_and_lane_and_recovered_by_the_policy(  # noqa: PLR0917 - parametrized
    stack: Connections,
    own_urls: ServerUrls,
    tmp_path: Path,
    kind: str,
    lane: str,
    action: str,
    kernel: bool,
) -> None:
    if kernel:
        require(KERNEL)
    job_id = f"drill-{kind}"
    command = (sys.executable, "-m", "lanes_agent.drill_workload", "--step-s", "0.05", "--timeout-s", "15")
    job = spec(
        "drill",
        workers=4,
        command=command,
        checkpoint_location=str(tmp_path / "checkpoints"),
        host_memory_gib=4.0,
    )
    await LanesClient(stack.nc, "tests").publish(
        JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=job))
    )
    await eventually(lambda: _checkpointed(stack, job_id), timeout_s=180, what="the drill job's first checkpoint")

    ran = await run_lanes_async(
        own_urls, "drill", job_id, "--kind", kind, "--rank", str(DRILLED_RANK), "--timeout", "240", "--json"
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    (report,) = json.loads(ran.stdout)["drills"]
    assert report["named_right"], report
    if kind != "link-down":  # a node's fault: the node is named, and any of its ranks (or none) will do
        assert report["named"]["rank"] == DRILLED_RANK
    assert report["named"]["lane"] == lane
    assert report["decision"] == action
    assert report["detect_s"] is not None
    assert report["localise_s"] is not None
    assert report["decide_s"] is not None
    if action == "resume":
        assert report["recover_s"] is not None  # the next attempt ran, on the nodes left
    poc = await run_lanes_async(own_urls, "poc", "--job", job_id, "--json")
    drills = {row["capability"]: row for row in json.loads(poc.stdout)["capabilities"]}["fault drills"]
    assert drills["verdict"] == "passed", drills


async def _checkpointed_at(conns: Connections, job_id: str, step: int) -> bool:
    timeline = await job_timeline(conns.nc.jetstream(), job_id)
    return any(isinstance(entry.event, CheckpointSaved) and entry.event.data.step >= step for entry in timeline)


async def _drill_past_the_baseline(
    stack: Connections, own_urls: ServerUrls, tmp_path: Path, kind: DrillKind
) -> dict[str, Any]:
    """Run the drill workload past the steps telemetry reads as its baseline, then drill rank 2 as a plan would."""
    job_id = f"drill-{kind.value}"
    # A collective timeout well past a slowed link's longest step: the drill slows the job, it must fail nothing.
    command = (sys.executable, "-m", "lanes_agent.drill_workload", "--step-s", "0.05", "--timeout-s", "30")
    job = spec("drill", workers=4, command=command, checkpoint_location=str(tmp_path / "checkpoints"))
    await LanesClient(stack.nc, "tests").publish(
        JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=job))
    )
    # Past the steps telemetry reads as the attempt's baseline (its first 30), so the slowdown is a change.
    await eventually(
        lambda: _checkpointed_at(stack, job_id, STRAGGLER_READY_STEP), timeout_s=180, what="the drill job past step 60"
    )
    duration = str(STRAGGLER_DURATION_S[kind])
    ran = await run_lanes_async(
        own_urls, "drill", job_id, "--kind", kind.value, "--rank", str(DRILLED_RANK), "--duration", duration,
        "--timeout", "150", "--json",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    (report,) = json.loads(ran.stdout)["drills"]
    assert report["named_right"], report
    assert report["localise_s"] is not None
    # Nothing failed: recovery only weighs a restart, and this job sets no `steps`, so it runs on, and says why.
    (decided,) = await wait_for(LanesClient(stack.nc, "tests"), job_id, RecoveryDecided)
    assert decided.data.action is RecoveryAction.NONE
    assert "the spec sets no `steps`" in decided.data.reason
    return dict(report)


async def test_a_slow_rank_that_fails_nothing_is_named_by_its_slowdown(
    stack: Connections, own_urls: ServerUrls, tmp_path: Path
) -> None:
    report = await _drill_past_the_baseline(stack, own_urls, tmp_path, DrillKind.SLOW)
    assert report["named"] == {
        "lane": "host", "category": "compute_straggler", "node": report["node"], "rank": DRILLED_RANK,
    }  # fmt: skip


@pytest.mark.skipif(_NO_NETNS is not None, reason=_NO_NETNS or "")
async def test_a_slowed_link_that_fails_nothing_is_named_a_degraded_link_on_its_node(
    stack: Connections, own_urls: ServerUrls, tmp_path: Path
) -> None:
    report = await _drill_past_the_baseline(stack, own_urls, tmp_path, DrillKind.LINK_SLOW)
    # The link's node, in the network lane; no rank is the one the others wait for (in a ring they all wait).
    assert report["named"] == {
        "lane": "network", "category": "degraded_link", "node": report["node"], "rank": None,
    }  # fmt: skip
    assert not _shaped(report["node"])  # the drill gave the link its full rate back


def _shaped(node: str) -> bool:
    shown = subprocess.run(["tc", "qdisc", "show", "dev", link_of(node)], capture_output=True, text=True, check=True)  # noqa: S607
    return "tbf" in shown.stdout
