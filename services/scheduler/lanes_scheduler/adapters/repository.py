"""The scheduler's PostgreSQL projection: nodes, job attempts it knows, and GPU allocations."""

from __future__ import annotations

import json
from dataclasses import dataclass

from lanes_common.events import NodeRegisteredData, RankAssignment
from lanes_common.store import Db
from lanes_scheduler.domain.placement import GangRequest, NodeCapacity

# Scheduling decisions read capacity and then write allocations; one advisory lock per transaction keeps
# two consumers (or two replicas) from deciding on the same snapshot.
_SCHEDULING_LOCK = 0x5343484544  # "SCHED"


@dataclass(frozen=True)
class PendingJob:
    """A job attempt waiting for placement, with the reason it was last given."""

    job_id: str
    attempt: int
    request: GangRequest
    wait_reason: str | None


async def lock_scheduling(conn: Db) -> None:
    """Serialize scheduling decisions until the end of the current transaction."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEDULING_LOCK)


async def upsert_node(conn: Db, node_id: str, data: NodeRegisteredData) -> None:
    """Record a node and its GPUs (a re-registration updates them)."""
    await conn.execute(
        """INSERT INTO scheduler_nodes (node_id, gpu_model, gpus, gpu_memory_gib, labels)
           VALUES ($1, $2, $3, $4, $5::jsonb)
           ON CONFLICT (node_id) DO UPDATE SET gpu_model = EXCLUDED.gpu_model, gpus = EXCLUDED.gpus,
               gpu_memory_gib = EXCLUDED.gpu_memory_gib, labels = EXCLUDED.labels""",
        node_id,
        data.gpu_model,
        data.gpus,
        data.gpu_memory_gib,
        json.dumps(data.labels),
    )


async def add_pending_job(conn: Db, job_id: str, attempt: int, request: GangRequest, seq: int) -> None:
    """Queue a job attempt for placement."""
    await conn.execute(
        """INSERT INTO scheduler_jobs (job_id, attempt, workers, gpus_per_worker, gpu_model, status, submitted_seq)
           VALUES ($1, $2, $3, $4, $5, 'pending', $6)""",
        job_id,
        attempt,
        request.workers,
        request.gpus_per_worker,
        request.gpu_model,
        seq,
    )


async def capacity(conn: Db) -> tuple[tuple[NodeCapacity, ...], dict[str, int]]:
    """Free GPUs per node, and each node's total GPU count."""
    rows = await conn.fetch(
        """SELECT n.node_id, n.gpu_model, n.gpu_memory_gib, n.gpus,
                  coalesce(array_agg(a.gpu_index) FILTER (WHERE a.gpu_index IS NOT NULL), '{}') AS used
           FROM scheduler_nodes n LEFT JOIN scheduler_allocations a USING (node_id)
           GROUP BY n.node_id ORDER BY n.node_id"""
    )
    nodes = tuple(
        NodeCapacity(
            node_id=row["node_id"],
            gpu_model=row["gpu_model"],
            gpu_memory_gib=row["gpu_memory_gib"],
            free_gpus=tuple(i for i in range(row["gpus"]) if i not in set(row["used"])),
        )
        for row in rows
    )
    return nodes, {row["node_id"]: row["gpus"] for row in rows}


async def pending_jobs(conn: Db) -> list[PendingJob]:
    """Job attempts waiting for placement, oldest submission first."""
    rows = await conn.fetch(
        """SELECT job_id, attempt, workers, gpus_per_worker, gpu_model, wait_reason
           FROM scheduler_jobs WHERE status = 'pending' ORDER BY submitted_seq"""
    )
    return [
        PendingJob(
            job_id=row["job_id"],
            attempt=row["attempt"],
            request=GangRequest(row["workers"], row["gpus_per_worker"], row["gpu_model"]),
            wait_reason=row["wait_reason"],
        )
        for row in rows
    ]


async def set_wait_reason(conn: Db, job: PendingJob, reason: str) -> None:
    """Remember the reason last published for a waiting job."""
    await conn.execute(
        "UPDATE scheduler_jobs SET wait_reason = $3 WHERE job_id = $1 AND attempt = $2", job.job_id, job.attempt, reason
    )


async def allocate(conn: Db, job: PendingJob, assignments: tuple[RankAssignment, ...]) -> None:
    """Hold the GPUs of a placement and mark the job attempt placed."""
    await conn.executemany(
        "INSERT INTO scheduler_allocations (node_id, gpu_index, job_id, attempt, rank) VALUES ($1, $2, $3, $4, $5)",
        [(a.node, gpu, job.job_id, job.attempt, a.rank) for a in assignments for gpu in a.gpus],
    )
    await conn.execute(
        "UPDATE scheduler_jobs SET status = 'placed', wait_reason = NULL WHERE job_id = $1 AND attempt = $2",
        job.job_id,
        job.attempt,
    )


async def release(conn: Db, job_id: str, attempt: int) -> tuple[tuple[str, ...], int] | None:
    """Free the GPUs of a finished job attempt; return (nodes, gpu count), or None if the attempt is unknown."""
    status = await conn.fetchval(
        "UPDATE scheduler_jobs SET status = 'done' WHERE job_id = $1 AND attempt = $2 RETURNING status",
        job_id,
        attempt,
    )
    if status is None:
        return None
    rows = await conn.fetch(
        "DELETE FROM scheduler_allocations WHERE job_id = $1 AND attempt = $2 RETURNING node_id", job_id, attempt
    )
    nodes = tuple(dict.fromkeys(sorted(row["node_id"] for row in rows)))
    return nodes, len(rows)
