"""The scheduler's ports on PostgreSQL: the repository functions bound to the consumer's transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from lanes_contract.events import NodeRegisteredData
from lanes_contract.jobs import JobSpec
from lanes_contract.topology import ClusterPolicy, Node, NodeStatus
from lanes_runtime.store import Db
from lanes_scheduler.adapters import repository
from lanes_scheduler.domain.admission import Gang, Holding, Placed
from lanes_scheduler.domain.queue import PendingJob, Release
from lanes_scheduler.service_layer.ports import Batch, QueuedAttempt, WaitEnd, WaitUpdate


@dataclass(frozen=True)
class PostgresScheduling:
    """`SchedulingRepository` on one open transaction."""

    conn: Db

    async def lock_scheduling(self) -> None:
        """Serialize scheduling decisions until the end of the transaction."""
        return await repository.lock_scheduling(self.conn)

    async def state_token(self) -> str:
        """The token of the last committed change of capacity."""
        return await repository.state_token(self.conn)

    async def set_state_token(self, token: str) -> None:
        """Mark a change of capacity in this transaction."""
        return await repository.set_state_token(self.conn, token)

    async def upsert_node(self, node_id: str, data: NodeRegisteredData) -> None:
        """Record a node's inventory and place in the topology."""
        return await repository.upsert_node(self.conn, node_id, data)

    async def set_node_state(self, node_id: str, status: NodeStatus) -> bool:
        """Change a known node's state; False for an unknown node."""
        return await repository.set_node_state(self.conn, node_id, status)

    async def set_policy(self, policy: ClusterPolicy) -> None:
        """Replace the pools and quotas."""
        return await repository.set_policy(self.conn, policy)

    async def policy(self) -> ClusterPolicy:
        """The current pools and quotas."""
        return await repository.policy(self.conn)

    async def nodes(self) -> list[Node]:
        """Every known node."""
        return await repository.nodes(self.conn)

    async def holdings(self) -> list[Holding]:
        """GPUs held per attempt and node."""
        return await repository.holdings(self.conn)

    async def add_pending_jobs(self, queued: Sequence[QueuedAttempt]) -> set[tuple[str, int]]:
        """Queue attempts (one round's, together); return those added, leaving the already known as they are."""
        return await repository.add_pending_jobs(self.conn, queued)

    async def original_spec(self, job_id: str) -> JobSpec | None:
        """The spec of the job's first attempt."""
        return await repository.original_spec(self.conn, job_id)

    async def pending_jobs(self) -> list[PendingJob]:
        """Attempts waiting for placement."""
        return await repository.pending_jobs(self.conn)

    async def allocate(self, placed: Sequence[Placed]) -> None:
        """Hold the placements' GPUs and mark their attempts placed (one round's, together)."""
        return await repository.allocate(self.conn, placed)

    async def reject(self, gang: Gang) -> None:
        """Mark an attempt that can never be placed."""
        return await repository.reject(self.conn, gang)

    async def release(self, job_id: str, attempt: int, cause_id: str, at: datetime) -> Release:
        """Free a finished attempt's GPUs exactly once."""
        return await repository.release(self.conn, job_id, attempt, cause_id, at)

    async def close_waits(self, ended: Sequence[WaitEnd]) -> None:
        """End these attempts' current wait reasons."""
        return await repository.close_waits(self.conn, ended)

    async def record_waits(self, updates: Sequence[WaitUpdate]) -> None:
        """Record why these attempts wait (one round's reasons, together)."""
        return await repository.record_waits(self.conn, updates)


@dataclass(frozen=True)
class SchedulerUnitOfWork:
    """The repository on the consumer's open transaction and the position of the event being applied."""

    conn: Db
    stream_seq: int
    batch: Batch | None = None

    @property
    def repo(self) -> PostgresScheduling:
        """The projection, on this transaction."""
        return PostgresScheduling(self.conn)
