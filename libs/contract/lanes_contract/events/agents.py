"""A node agent's heartbeat: that it is alive, what it runs, and what the node has (its inventory).

Heartbeats travel on their own family (`lanes.beat.<node>.agent`) and stream, which keeps only the latest
per node: they say "alive now", so their history is noise, and they stay off the 90-day node timeline.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AwareDatetime, Field

from lanes_contract.events.base import Data, Event, Family, Lane

InventorySource = Literal["nvidia-smi", "host"]


class GpuDevice(Data):
    """One GPU as `nvidia-smi -q -x` describes it."""

    index: int = Field(ge=0, description="The GPU's minor number (its /dev/nvidiaN).")
    name: str = Field(max_length=128, description="Product name, e.g. NVIDIA H100 80GB HBM3.")
    uuid: str = Field(max_length=128)
    pci_bus_id: str = Field(max_length=64)
    memory_mib: int = Field(ge=0, description="Total framebuffer memory.")
    ecc_uncorrected: int | None = Field(
        default=None, ge=0, description="Volatile uncorrectable ECC errors since the driver loaded, where reported."
    )
    repair_pending: bool = Field(
        default=False, description="A row remap or page retirement waits for a GPU reset (the GPU is degraded)."
    )


class NodeInventory(Data):
    """What the node has, as its agent sees it."""

    source: InventorySource = Field(description="nvidia-smi when present, otherwise the host alone (no GPUs).")
    hostname: str = Field(max_length=256)
    cpus: int = Field(ge=1)
    memory_gib: float = Field(ge=0)
    driver_version: str | None = Field(default=None, max_length=64)
    cuda_version: str | None = Field(default=None, max_length=64)
    gpus: tuple[GpuDevice, ...] = Field(default=(), max_length=64)
    problem: str | None = Field(
        default=None, max_length=1024, description="Why the GPU inventory could not be read (nvidia-smi failed)."
    )


class AgentHeartbeatData(Data):
    """An agent alive on its node."""

    agent: str = Field(min_length=1, max_length=128, description="The agent's consumer (one per set of nodes).")
    started_at: AwareDatetime = Field(description="When this run of the agent started (a change means a restart).")
    interval_s: float = Field(gt=0, description="The next heartbeat is due this many seconds later.")
    running_ranks: int = Field(ge=0)
    kernel_log: str = Field(
        max_length=512, description="`following`, `off`, or why the kernel log cannot be read (evidence missing)."
    )
    inventory: NodeInventory


class AgentHeartbeat(Event):
    """A node agent is alive: what it runs now, whether it reads the kernel log, and the node's inventory."""

    family = Family.BEAT
    name = "agent"
    lane: Lane = Lane.HOST
    data: AgentHeartbeatData
