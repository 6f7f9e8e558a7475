"""What the node agents' heartbeats say about the cluster: who is silent, and what differs from the record.

Pure: heartbeats and registrations in, one row per node out. A node is a problem when its agent has missed
three beats, when no agent was ever heard for a registered node, when its agent cannot read the kernel log or
nvidia-smi, when it sees fewer GPUs than the node was registered with, or when a GPU reports uncorrectable
ECC errors or a pending repair.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from lanes_contract.events import AgentHeartbeat, NodeInventory

MISSED_BEATS = 3
"""Beats an agent may miss before its node counts as silent (one lost beat is no outage)."""
_READABLE_LOG = frozenset({"following", "off"})


@dataclass(frozen=True)
class NodeHealth:
    """One node as its agent last described it, and what is wrong with that."""

    node: str
    registered_gpus: int | None
    agent: str | None = None
    heard_s_ago: float | None = None
    running_ranks: int = 0
    kernel_log: str | None = None
    inventory: NodeInventory | None = None
    problems: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The row of `lanes topology agents --json`."""
        return {
            "node": self.node,
            "registered_gpus": self.registered_gpus,
            "agent": self.agent,
            "heard_s_ago": None if self.heard_s_ago is None else round(self.heard_s_ago, 1),
            "running_ranks": self.running_ranks,
            "kernel_log": self.kernel_log,
            "inventory": None if self.inventory is None else self.inventory.model_dump(mode="json"),
            "problems": list(self.problems),
        }


def _problems(beat: AgentHeartbeat, registered_gpus: int | None, heard_s_ago: float) -> list[str]:
    data, inventory = beat.data, beat.data.inventory
    problems = []
    if heard_s_ago > MISSED_BEATS * data.interval_s:
        problems.append(f"agent silent for {heard_s_ago:.0f} s (beats every {data.interval_s:g} s)")
    if data.kernel_log not in _READABLE_LOG:
        problems.append(data.kernel_log)
    if inventory.problem:
        problems.append(inventory.problem)
    if inventory.source == "nvidia-smi" and registered_gpus is not None and len(inventory.gpus) < registered_gpus:
        problems.append(f"registered with {registered_gpus} GPUs, nvidia-smi sees {len(inventory.gpus)}")
    for gpu in inventory.gpus:
        said = []
        if gpu.ecc_uncorrected:
            said.append(f"{gpu.ecc_uncorrected} uncorrectable ECC error{'s' if gpu.ecc_uncorrected > 1 else ''}")
        if gpu.repair_pending:
            said.append("repair pending (needs a reset)")
        if said:
            problems.append(f"GPU {gpu.index} ({gpu.pci_bus_id}): {', '.join(said)}")
    return problems


def node_health(beats: Sequence[AgentHeartbeat], registered_gpus: Mapping[str, int], now: datetime) -> list[NodeHealth]:
    """Every node that is registered or has an agent, by name; the latest beat of each node counts."""
    latest: dict[str, AgentHeartbeat] = {}
    for beat in beats:
        if beat.node is not None and (beat.node not in latest or beat.time > latest[beat.node].time):
            latest[beat.node] = beat
    rows = []
    for node in sorted(set(latest) | set(registered_gpus)):
        gpus = registered_gpus.get(node)
        if node not in latest:
            rows.append(NodeHealth(node, gpus, problems=("no agent heard",)))
            continue
        beat = latest[node]
        heard_s_ago = max(0.0, (now - beat.time).total_seconds())
        rows.append(
            NodeHealth(
                node,
                gpus,
                agent=beat.data.agent,
                heard_s_ago=heard_s_ago,
                running_ranks=beat.data.running_ranks,
                kernel_log=beat.data.kernel_log,
                inventory=beat.data.inventory,
                problems=tuple(_problems(beat, gpus, heard_s_ago)),
            )
        )
    return rows
