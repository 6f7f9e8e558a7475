"""What the scheduler's handlers need from the outside world, as Protocols (adapters implement them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from lanes_contract.events import NodeRegisteredData
from lanes_contract.jobs import JobSpec
from lanes_contract.topology import ClusterPolicy, Node, NodeStatus
from lanes_runtime.consumer import BeforeCommit
from lanes_scheduler.domain.admission import Gang, Holding, Placed, Waiting
from lanes_scheduler.domain.queue import PendingJob, Release


@dataclass(frozen=True)
class QueuedAttempt:
    """A job attempt to queue for placement."""

    job_id: str
    attempt: int
    spec: JobSpec
    seq: int
    """The stream sequence of the event that queued it: its place in the queue among equal priorities."""
    avoid_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class WaitEnd:
    """An attempt's open wait reason ends: it was placed, rejected or released."""

    job_id: str
    attempt: int
    at: datetime
    ended_by: str


@dataclass(frozen=True)
class WaitUpdate:
    """Why an attempt waits, as a scheduling round decided it."""

    waiting: Waiting
    seq: int
    """The stream sequence of the event that queued the attempt."""
    at: datetime
    changed: bool
    """A new reason (the open one ends, this one opens), not new details of the same reason."""


class SchedulingRepository(Protocol):
    """The scheduler's projection (nodes, policy, attempts, allocations, waits) in one transaction."""

    async def lock_scheduling(self) -> None:
        """Serialize scheduling decisions until the end of the transaction."""
        ...

    async def state_token(self) -> str:
        """The token of the last committed change of capacity."""
        ...

    async def set_state_token(self, token: str) -> None:
        """Mark a change of capacity in this transaction."""
        ...

    async def upsert_node(self, node_id: str, data: NodeRegisteredData) -> None:
        """Record a node's inventory and place in the topology."""
        ...

    async def set_node_state(self, node_id: str, status: NodeStatus) -> bool:
        """Change a known node's state; False for an unknown node."""
        ...

    async def set_policy(self, policy: ClusterPolicy) -> None:
        """Replace the pools and quotas."""
        ...

    async def policy(self) -> ClusterPolicy:
        """The current pools and quotas."""
        ...

    async def nodes(self) -> list[Node]:
        """Every known node."""
        ...

    async def holdings(self) -> list[Holding]:
        """GPUs held per attempt and node."""
        ...

    async def add_pending_jobs(self, queued: Sequence[QueuedAttempt]) -> set[tuple[str, int]]:
        """Queue attempts (one round's, together); return those added, leaving the already known as they are."""
        ...

    async def original_spec(self, job_id: str) -> JobSpec | None:
        """The spec of the job's first attempt."""
        ...

    async def pending_jobs(self) -> list[PendingJob]:
        """Attempts waiting for placement."""
        ...

    async def allocate(self, placed: Sequence[Placed]) -> None:
        """Hold the placements' GPUs and mark their attempts placed (one round's, together)."""
        ...

    async def reject(self, gang: Gang) -> None:
        """Mark an attempt that can never be placed."""
        ...

    async def release(self, job_id: str, attempt: int, cause_id: str, at: datetime) -> Release:
        """Free a finished attempt's GPUs exactly once."""
        ...

    async def close_waits(self, ended: Sequence[WaitEnd]) -> None:
        """End these attempts' current wait reasons."""
        ...

    async def record_waits(self, updates: Sequence[WaitUpdate]) -> None:
        """Record why these attempts wait (one round's reasons, together)."""
        ...


class Batch(Protocol):
    """The transaction's other events: what they share, and work to do after the last of them.

    A fetched batch of events is applied in one transaction; the scheduler decides the queue once, after
    the batch's last event, instead of once per event.
    """

    @property
    def cache(self) -> dict[object, Any]:
        """State shared by the handlers of this transaction."""
        ...

    def before_commit(self, action: BeforeCommit) -> None:
        """Run `action` after the last event and before the commit; it returns (cause, output) pairs."""
        ...


class UnitOfWork(Protocol):
    """One transaction of the scheduler: its repository, and the stream position of the event it applies."""

    @property
    def repo(self) -> SchedulingRepository:
        """The projection, on this unit's transaction."""
        ...

    @property
    def stream_seq(self) -> int:
        """The stream sequence of the event being applied (it orders the queue)."""
        ...

    @property
    def batch(self) -> Batch | None:
        """The batch this event is applied in, or None: decide at once, as if each event were alone."""
        ...
