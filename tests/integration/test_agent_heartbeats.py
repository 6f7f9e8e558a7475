"""Node agents' heartbeats and inventory, read back by `lanes topology agents`, on a NATS with auth on.

Each `lanes agent` runs as its own process under its node's identity, with an `nvidia-smi` on its PATH that
prints an 8-GPU H100 node's XML (GPU 5 with uncorrectable ECC errors awaiting a row remap). The operator's
view must name what is wrong with each node, and notice an agent killed with kill -9.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from support.cli import lanes_process, run_lanes_async
from support.waiting import eventually

from lanes_contract.client import LanesClient
from lanes_contract.errors import PermissionDeniedError
from lanes_contract.events import (
    AgentHeartbeat,
    AgentHeartbeatData,
    NodeInventory,
    NodeRegistered,
    NodeRegisteredData,
    utc_now,
)
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.real_servers]
SAMPLE = Path(__file__).parent.parent / "data" / "nvidia_smi" / "h100x8_r550.xml"
BEAT_S = 0.5


@pytest.fixture
def gpu_path(tmp_path: Path) -> str:
    """A PATH whose `nvidia-smi -q -x` prints the 8-GPU sample, as the driver's tool would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f'#!/bin/sh\n[ "$1 $2" = "-q -x" ] || exit 2\nexec cat {SAMPLE}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return f"{bin_dir}:{os.environ['PATH']}"


def _agent(
    nats: EmbeddedNats, node: str, state: Path, path: str, *extra: str
) -> AbstractAsyncContextManager[asyncio.subprocess.Process]:
    args = ("agent", "--node", node, "--state-dir", str(state / node), "--heartbeat", str(BEAT_S), *extra)
    return lanes_process(*args, env={"NATS_URL": nats.url_for(f"agent-{node}"), "PATH": path})


async def _view(nats: EmbeddedNats) -> tuple[int, dict[str, dict[str, Any]]]:
    ran = await run_lanes_async(None, "topology", "agents", "--json", env={"NATS_URL": nats.url_for("cli")})
    return ran.returncode, {row["node"]: row for row in json.loads(ran.stdout)}


async def _register(nats: EmbeddedNats, gpus: dict[str, int]) -> None:
    async with await LanesClient.connect(nats.url_for("cli"), source="lanes/cli") as client:
        for node, count in gpus.items():
            data = NodeRegisteredData(gpu_model="H100", gpus=count, gpu_memory_gib=80)
            await client.publish(NodeRegistered(source=client.source, node=node, data=data))


async def test_agents_beat_with_their_inventory_and_the_view_names_each_nodes_problem(
    secured_nats: EmbeddedNats, tmp_path: Path, gpu_path: str
) -> None:
    # node-2 was registered with more GPUs than its nvidia-smi shows; node-3's agent never started.
    await _register(secured_nats, {"node-1": 8, "node-2": 16, "node-3": 8})
    async with (
        _agent(secured_nats, "node-1", tmp_path, gpu_path, "--kernel-log", str(tmp_path / "no-kmsg")),
        _agent(secured_nats, "node-2", tmp_path, gpu_path) as second,
    ):

        async def both_heard() -> bool:
            _, rows = await _view(secured_nats)
            return all(rows.get(n, {}).get("agent") for n in ("node-1", "node-2"))

        await eventually(both_heard, timeout_s=60, what="a heartbeat from each agent")
        code, rows = await _view(secured_nats)
        assert code == 1  # problems found
        first = rows["node-1"]
        assert first["agent"] == "agent-node-1"
        assert (first["inventory"]["source"], len(first["inventory"]["gpus"])) == ("nvidia-smi", 8)
        assert first["inventory"]["driver_version"] == "550.90.07"
        assert first["running_ranks"] == 0
        assert first["problems"] == [
            f"kernel log {tmp_path / 'no-kmsg'} unreadable: No such file or directory",
            "GPU 5 (00000000:AB:00.0): 2 uncorrectable ECC errors, repair pending (needs a reset)",
        ]
        assert rows["node-2"]["problems"] == [
            "registered with 16 GPUs, nvidia-smi sees 8",
            "GPU 5 (00000000:AB:00.0): 2 uncorrectable ECC errors, repair pending (needs a reset)",
        ]
        assert rows["node-3"]["problems"] == ["no agent heard"]

        second.kill()  # kill -9: its beats stop, and nothing says goodbye
        await second.wait()

        async def second_silent() -> bool:
            _, rows = await _view(secured_nats)
            return any(p.startswith("agent silent for") for p in rows["node-2"]["problems"])

        await eventually(second_silent, timeout_s=60, what="node-2's agent reported silent")
        _, rows = await _view(secured_nats)
        assert not any(p.startswith("agent silent") for p in rows["node-1"]["problems"])  # still beating


async def test_an_agent_may_beat_only_for_its_own_node(secured_nats: EmbeddedNats) -> None:
    def beat(node: str) -> AgentHeartbeat:
        inventory = NodeInventory(source="host", hostname="h", cpus=2, memory_gib=1.0)
        data = AgentHeartbeatData(
            agent="agent-node-1",
            started_at=utc_now(),
            interval_s=10,
            running_ranks=0,
            kernel_log="off",
            inventory=inventory,
        )
        return AgentHeartbeat(source="agent/node-1", node=node, data=data)

    async with await LanesClient.connect(secured_nats.url_for("agent-node-1"), source="agent/node-1") as agent:
        assert await agent.publish(beat("node-1")) > 0
        with pytest.raises(PermissionDeniedError, match=r"lanes\.beat\.node-2\."):
            await agent.publish(beat("node-2"))
