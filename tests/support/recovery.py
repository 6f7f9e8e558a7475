"""Shared by recovery's real-server tests: a stack of real services, a scripted launcher, log readers."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from lanes_cli.bootstrap import SERVICES, prepare_services
from lanes_cli.timeline import read_stream
from lanes_contract.client import LanesClient
from lanes_contract.events import (
    CheckpointSaved,
    CheckpointSavedData,
    CommunicatorReady,
    CommunicatorReadyData,
    Event,
    EvidenceData,
    Heartbeat,
    HeartbeatData,
    JobPlaced,
    JobSubmitted,
    JobSubmittedData,
    NodeRegistered,
    NodeRegisteredData,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    RendezvousDone,
    RendezvousDoneData,
)
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS, NODES
from lanes_recovery.domain.policy import Policy, parse_policy
from lanes_recovery.entrypoints.service import recovery_service
from lanes_runtime.reader import Selection
from lanes_runtime.service import Connections, connected, run_consumers
from lanes_runtime.settings import ServerUrls
from support.waiting import eventually

_E = TypeVar("_E", bound=Event)
MODEL = "sha256:" + "11" * 32
DATA = "sha256:" + "22" * 32
CONFIG = "sha256:" + "33" * 32
IMAGE = "registry.local/train:1"


def policy(**defaults: Any) -> Policy:
    """The shipped rules with other defaults (e.g. a short grace, no backoff, a small crash-loop count)."""
    from lanes_recovery.adapters.policies import default_policy  # noqa: PLC0415 - test helper

    shipped = default_policy()
    return shipped.model_copy(update={"defaults": shipped.defaults.model_copy(update=defaults), "version": 99})


def inline_policy(text: str) -> Policy:
    """A policy written in the test."""
    return parse_policy(text, origin="test")


@contextlib.asynccontextmanager
async def stack(urls: ServerUrls, recovery_policy: Policy, *others: str) -> AsyncIterator[Connections]:
    """Real services on real servers: recovery under `recovery_policy` plus `others` (scheduler, lifecycle...)."""
    async with connected(urls, name="recovery-tests") as conns:
        definitions = [SERVICES[name] for name in others]
        definitions.append(recovery_service(lambda: recovery_policy, tick_s=0.1))
        runners = await prepare_services(conns, definitions)
        stop = asyncio.Event()
        task = asyncio.create_task(run_consumers(runners, stop))
        try:
            yield conns
        finally:
            stop.set()
            await task


def spec(name: str = "train", **fields: Any) -> JobSpec:
    """A two-rank training spec with versions, an image and owners per lane."""
    values: dict[str, Any] = {
        "name": name,
        "workers": 2,
        "gpus_per_worker": 4,
        "model_version": MODEL,
        "data_version": DATA,
        "config_version": CONFIG,
        "image": IMAGE,
        "retry_budget": 3,
        "owners": {"algorithm": "ada", "host": "hal", "network": "nia", "platform": "pat"},
    }
    return JobSpec.model_validate(values | fields)


async def register_nodes(conns: Connections, client: LanesClient, nodes: Sequence[str], gpus: int = 4) -> None:
    """Put nodes into the scheduler's inventory, and wait until the scheduler has seen them."""
    for node in nodes:
        data = NodeRegisteredData(gpu_model="H100", gpus=gpus, gpu_memory_gib=80)
        await client.publish(NodeRegistered(source="tests", node=node, data=data))

    async def known() -> bool:
        return int(await conns.pool.fetchval("SELECT count(*) FROM scheduler_nodes")) >= len(nodes)

    await eventually(known, what=f"the scheduler to know {len(nodes)} nodes")


async def submit(client: LanesClient, job_id: str, job_spec: JobSpec) -> None:
    """Submit a job."""
    await client.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=job_spec)))


async def events_of(client: LanesClient, job_id: str, event_type: type[_E], subject: str = "") -> list[_E]:
    """Every event of a type on a job's timeline, in stream order."""
    name = subject or str(event_type.name)
    entries = await read_stream(client.js, Selection(JOBS.name, f"lanes.job.{job_id}.{name}"))
    return [e.event for e in entries if isinstance(e.event, event_type)]


async def sequenced(client: LanesClient, job_id: str) -> list[tuple[int, Event]]:
    """The job's whole timeline with stream sequences."""
    entries = await read_stream(client.js, Selection(JOBS.name, f"lanes.job.{job_id}.>"))
    return [(e.seq, e.event) for e in entries if e.event is not None]


async def node_events(client: LanesClient, node: str) -> list[Event]:
    """Every event on a node's subjects."""
    entries = await read_stream(client.js, Selection(NODES.name, f"lanes.node.{node}.>"))
    return [e.event for e in entries if e.event is not None]


async def wait_for(
    client: LanesClient, job_id: str, event_type: type[_E], count: int = 1, *, timeout_s: float = 60, **match: Any
) -> list[_E]:
    """Wait until the job's timeline holds `count` events of the type whose attributes equal `match`."""
    found: list[_E] = []

    async def enough() -> bool:
        nonlocal found
        found = [e for e in await events_of(client, job_id, event_type) if _matches(e, match)]
        return len(found) >= count

    await eventually(enough, timeout_s=timeout_s, what=f"{count} x {event_type.__name__} {match} of {job_id}")
    return found


def _matches(event: Event, match: dict[str, Any]) -> bool:
    for dotted, expected in match.items():
        value: Any = event
        for part in dotted.split("__"):
            value = getattr(value, part)
        if value != expected:
            return False
    return True


@dataclass
class Checkpoint:
    """A checkpoint file a rank wrote, and what its record says."""

    step: int
    path: Path
    digest: str


def write_checkpoint(directory: Path, step: int) -> Checkpoint:
    """Write a real checkpoint file and compute its digest, as a training loop would."""
    path = directory / f"step-{step}.pt"
    path.write_bytes(hashlib.sha256(f"weights at {step}".encode()).digest() * 64)
    return Checkpoint(step, path, "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest())


class ScriptedLauncher:
    """Plays the ranks of one placed attempt: start, rendezvous, ready, heartbeats, checkpoints, exits."""

    def __init__(self, client: LanesClient, placed: JobPlaced) -> None:
        self.client = client
        self.placed = placed
        self.job_id = placed.job_key
        self.attempt = placed.attempt or 1
        self._reported: Counter[int] = Counter()
        """Evidence each rank's output produced: its exit says how much, as a real agent's does."""

    def _keys(self, rank: int) -> dict[str, Any]:
        node = next(a.node for a in self.placed.data.assignments if a.rank == rank)
        return {"source": f"agent/{node}", "jobid": self.job_id, "attempt": self.attempt, "rank": rank, "node": node}

    @property
    def ranks(self) -> list[int]:
        """The ranks of the placement."""
        return [a.rank for a in self.placed.data.assignments]

    def node_of(self, rank: int) -> str:
        """Where a rank runs."""
        return str(self._keys(rank)["node"])

    async def start(self) -> None:
        """Every rank starts, finds its peers and initialises its communicator."""
        world = len(self.ranks)
        for rank in self.ranks:
            await self.client.publish(RankStarted(data=RankStartedData(pid=1000 + rank), **self._keys(rank)))
            await self.client.publish(RendezvousDone(data=RendezvousDoneData(world_size=world), **self._keys(rank)))
        for rank in self.ranks:
            await self.client.publish(CommunicatorReady(data=CommunicatorReadyData(backend="nccl"), **self._keys(rank)))

    async def steps(self, steps: Sequence[int]) -> None:
        """Heartbeats of every rank at these steps."""
        for step in steps:
            for rank in self.ranks:
                await self.client.publish(Heartbeat(data=HeartbeatData(step=step), **self._keys(rank)))

    async def checkpoint(self, saved: Checkpoint, **versions: Any) -> None:
        """Rank 0 records a checkpoint, with the versions it was trained with (the spec's unless overridden)."""
        recorded = {"model_version": MODEL, "data_version": DATA, "config_version": CONFIG, "image": IMAGE}
        data = CheckpointSavedData(step=saved.step, path=str(saved.path), digest=saved.digest, **recorded | versions)
        await self.client.publish(CheckpointSaved(data=data, **self._keys(0)))

    async def output(self, rank: int, cls: type[Event], **data: Any) -> None:
        """Evidence read from one rank's output (a traceback, a watchdog line), attributed to that rank."""
        await self.client.publish(cls(data=EvidenceData(**data), **self._keys(rank)))
        self._reported[rank] += 1

    async def exit(self, rank: int, exit_code: int | None = 0, signal: int | None = None) -> None:
        """One rank's process ends; its exit counts the evidence its output produced, so telemetry waits for it."""
        data = RankExitedData(exit_code=exit_code, signal=signal, evidence=self._reported[rank])
        await self.client.publish(RankExited(data=data, **self._keys(rank)))
