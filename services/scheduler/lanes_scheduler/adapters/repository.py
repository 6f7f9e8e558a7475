"""The scheduler's PostgreSQL projection: nodes, policy, job attempts, GPU allocations and wait history."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import structlog

from lanes_contract.events import NodeRegisteredData
from lanes_contract.jobs import JobSpec
from lanes_contract.topology import ClusterPolicy, Node, NodeState, NodeStatus
from lanes_runtime.store import Db
from lanes_scheduler.domain.admission import Gang, Holding, Placed, Waiting
from lanes_scheduler.domain.queue import PendingJob, Release, gang_of
from lanes_scheduler.service_layer.ports import QueuedAttempt, WaitEnd, WaitUpdate

log = structlog.get_logger(__name__)

# Scheduling decisions read capacity and then write allocations; one advisory lock per transaction keeps
# two consumers (or two replicas, or two scheduler processes) from deciding on the same snapshot. The
# primary key on (node, gpu) of the allocations is the backstop: a double booking cannot commit.
_SCHEDULING_LOCK = 0x5343484544  # "SCHED"


async def lock_scheduling(conn: Db) -> None:
    """Serialize scheduling decisions until the end of the current transaction."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEDULING_LOCK)


async def state_token(conn: Db) -> str:
    """The token of the last committed change of capacity (read under the scheduling lock)."""
    return str(await conn.fetchval("SELECT token FROM scheduler_state WHERE id = 1"))


async def set_state_token(conn: Db, token: str) -> None:
    """Mark a change of capacity in this transaction."""
    await conn.execute("UPDATE scheduler_state SET token = $1 WHERE id = 1", token)


# --- nodes and policy ------------------------------------------------------------------------------


async def upsert_node(conn: Db, node_id: str, data: NodeRegisteredData) -> None:
    """Record a node, its GPUs and where it sits (a re-registration updates them, not its state)."""
    await conn.execute(
        """INSERT INTO scheduler_nodes
               (node_id, gpu_model, gpus, gpu_memory_gib, labels, nvlink_domain, leaf, spine, rack, pool)
           VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9, $10)
           ON CONFLICT (node_id) DO UPDATE SET gpu_model = EXCLUDED.gpu_model, gpus = EXCLUDED.gpus,
               gpu_memory_gib = EXCLUDED.gpu_memory_gib, labels = EXCLUDED.labels,
               nvlink_domain = EXCLUDED.nvlink_domain, leaf = EXCLUDED.leaf, spine = EXCLUDED.spine,
               rack = EXCLUDED.rack, pool = EXCLUDED.pool""",
        node_id,
        data.gpu_model,
        data.gpus,
        data.gpu_memory_gib,
        json.dumps(data.labels),
        data.nvlink_domain,
        data.leaf,
        data.spine,
        data.rack,
        data.pool,
    )


async def set_node_state(conn: Db, node_id: str, status: NodeStatus) -> bool:
    """Change a known node's state; False when the node is unknown."""
    updated = await conn.fetchval(
        """UPDATE scheduler_nodes SET state = $2, state_reason = $3, state_owner = $4, state_since = $5
           WHERE node_id = $1 RETURNING true""",
        node_id,
        status.state.value,
        status.reason,
        status.owner_lane,
        status.since,
    )
    return bool(updated)


async def set_policy(conn: Db, policy: ClusterPolicy) -> None:
    """Replace the pools and tenant quotas."""
    await conn.execute(
        """INSERT INTO scheduler_policy (id, policy) VALUES (1, $1::jsonb)
           ON CONFLICT (id) DO UPDATE SET policy = EXCLUDED.policy""",
        policy.model_dump_json(),
    )


async def policy(conn: Db) -> ClusterPolicy:
    """The current pools and tenant quotas (none: every pool open, no quotas)."""
    raw = await conn.fetchval("SELECT policy FROM scheduler_policy WHERE id = 1")
    return ClusterPolicy() if raw is None else ClusterPolicy.model_validate_json(raw)


async def nodes(conn: Db) -> list[Node]:
    """Every known node with its topology and state."""
    rows = await conn.fetch("SELECT * FROM scheduler_nodes ORDER BY node_id")
    return [
        Node(
            node_id=row["node_id"],
            gpu_model=row["gpu_model"],
            gpus=row["gpus"],
            gpu_memory_gib=row["gpu_memory_gib"],
            nvlink_domain=row["nvlink_domain"],
            leaf=row["leaf"],
            spine=row["spine"],
            rack=row["rack"],
            pool=row["pool"],
            labels=json.loads(row["labels"]),
            status=NodeStatus(
                state=NodeState(row["state"]),
                reason=row["state_reason"],
                owner_lane=row["state_owner"],
                since=row["state_since"],
            ),
        )
        for row in rows
    ]


async def holdings(conn: Db) -> list[Holding]:
    """GPUs held per job attempt and node, with the attempt's tenant and pool."""
    rows = await conn.fetch(
        """SELECT a.job_id, a.attempt, a.node_id, array_agg(a.gpu_index ORDER BY a.gpu_index) AS gpus,
                  j.tenant, j.pool
           FROM scheduler_allocations a JOIN scheduler_jobs j USING (job_id, attempt)
           GROUP BY a.job_id, a.attempt, a.node_id, j.tenant, j.pool ORDER BY a.job_id, a.attempt, a.node_id"""
    )
    return [
        Holding(f"{r['job_id']}/{r['attempt']}", r["tenant"], r["pool"], r["node_id"], tuple(r["gpus"])) for r in rows
    ]


# --- job attempts ----------------------------------------------------------------------------------


async def add_pending_jobs(conn: Db, queued: Sequence[QueuedAttempt]) -> set[tuple[str, int]]:
    """Queue job attempts for placement, each never to go on its `avoid_nodes`, in one statement.

    Returns the attempts added; one already known (a duplicate submission or attempt) is left as it is.
    """
    if not queued:
        return set()
    rows = await conn.fetch(
        """INSERT INTO scheduler_jobs (job_id, attempt, workers, gpus_per_worker, gpu_model, status, submitted_seq,
                                       spec, tenant, pool, priority, avoid_nodes)
           SELECT q.job_id, q.attempt, q.workers, q.gpus_per_worker, q.gpu_model, 'pending', q.seq, q.spec, q.tenant,
                  q.pool, q.priority, ARRAY(SELECT jsonb_array_elements_text(q.avoid))
           FROM unnest($1::text[], $2::int[], $3::int[], $4::int[], $5::text[], $6::bigint[], $7::jsonb[], $8::text[],
                       $9::text[], $10::int[], $11::jsonb[])
                AS q(job_id, attempt, workers, gpus_per_worker, gpu_model, seq, spec, tenant, pool, priority, avoid)
           ON CONFLICT (job_id, attempt) DO NOTHING RETURNING job_id, attempt""",
        [q.job_id for q in queued],
        [q.attempt for q in queued],
        [q.spec.workers for q in queued],
        [q.spec.gpus_per_worker for q in queued],
        [q.spec.gpu_model for q in queued],
        [q.seq for q in queued],
        [q.spec.model_dump_json() for q in queued],
        [q.spec.tenant for q in queued],
        [q.spec.pool for q in queued],
        [q.spec.priority for q in queued],
        [json.dumps(sorted(set(q.avoid_nodes))) for q in queued],
    )
    return {(row["job_id"], int(row["attempt"])) for row in rows}


async def original_spec(conn: Db, job_id: str) -> JobSpec | None:
    """The spec of the job's first submitted attempt, as the scheduler stored it."""
    raw = await conn.fetchval(
        "SELECT spec FROM scheduler_jobs WHERE job_id = $1 AND spec IS NOT NULL ORDER BY attempt LIMIT 1", job_id
    )
    return None if raw is None else JobSpec.model_validate_json(raw)


async def pending_jobs(conn: Db) -> list[PendingJob]:
    """Job attempts waiting for placement (the order of the queue is the domain's business)."""
    rows = await conn.fetch(
        """SELECT j.job_id, j.attempt, j.spec, j.submitted_seq, j.avoid_nodes, w.reason AS wait_reason,
                  w.detail AS wait_detail, w.queue_position
           FROM scheduler_jobs j
           LEFT JOIN scheduler_waits w ON w.job_id = j.job_id AND w.attempt = j.attempt AND w.ended_at IS NULL
           WHERE j.status = 'pending' ORDER BY j.submitted_seq"""
    )
    return [
        PendingJob(
            gang=gang_of(
                r["job_id"],
                r["attempt"],
                JobSpec.model_validate_json(r["spec"]),
                r["submitted_seq"],
                avoid_nodes=r["avoid_nodes"],
            ),
            wait_reason=r["wait_reason"],
            wait_detail=r["wait_detail"],
            queue_position=r["queue_position"],
        )
        for r in rows
    ]


async def allocate(conn: Db, placed: Sequence[Placed]) -> None:
    """Hold the GPUs of placements and mark their attempts placed (the primary key refuses a double booking)."""
    if not placed:
        return
    await conn.executemany(
        "INSERT INTO scheduler_allocations (node_id, gpu_index, job_id, attempt, rank) VALUES ($1, $2, $3, $4, $5)",
        [(a.node, gpu, p.gang.job_id, p.gang.attempt, a.rank) for p in placed for a in p.assignments for gpu in a.gpus],
    )
    await conn.executemany(
        "UPDATE scheduler_jobs SET status = 'placed', wait_reason = NULL WHERE job_id = $1 AND attempt = $2",
        [(p.gang.job_id, p.gang.attempt) for p in placed],
    )


async def reject(conn: Db, gang: Gang) -> None:
    """Mark an attempt that can never be placed."""
    await conn.execute(
        "UPDATE scheduler_jobs SET status = 'rejected' WHERE job_id = $1 AND attempt = $2", gang.job_id, gang.attempt
    )


async def release(conn: Db, job_id: str, attempt: int, cause_id: str, at: datetime) -> Release:
    """Free the GPUs of a finished attempt exactly once; a second request is refused and logged."""
    status = await conn.fetchval(
        """UPDATE scheduler_jobs SET status = 'done'
           WHERE job_id = $1 AND attempt = $2 AND status <> 'done' RETURNING status""",
        job_id,
        attempt,
    )
    if status is None:
        known = await conn.fetchval(
            "SELECT true FROM scheduler_jobs WHERE job_id = $1 AND attempt = $2", job_id, attempt
        )
        outcome = "double_release" if known else "unknown_attempt"
        log.warning("release refused", outcome=outcome, job_id=job_id, attempt=attempt, cause_id=cause_id)
        await _log_release(conn, job_id, attempt, cause_id, outcome, 0, at)
        return Release(outcome)
    rows = await conn.fetch(
        "DELETE FROM scheduler_allocations WHERE job_id = $1 AND attempt = $2 RETURNING node_id", job_id, attempt
    )
    await close_wait(conn, job_id, attempt, at, "released")
    await _log_release(conn, job_id, attempt, cause_id, "released", len(rows), at)
    return Release("released", tuple(dict.fromkeys(sorted(row["node_id"] for row in rows))), len(rows))


async def _log_release(  # noqa: PLR0917 - one row's columns, in table order
    conn: Db, job_id: str, attempt: int, cause_id: str, outcome: str, gpus: int, at: datetime
) -> None:
    await conn.execute(
        """INSERT INTO scheduler_releases (job_id, attempt, cause_id, outcome, gpus, at)
           VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (cause_id) DO NOTHING""",
        job_id,
        attempt,
        cause_id,
        outcome,
        gpus,
        at,
    )


# --- wait history ----------------------------------------------------------------------------------


_CLOSE_WAIT = """UPDATE scheduler_waits SET ended_at = $3, ended_by = $4
                 WHERE job_id = $1 AND attempt = $2 AND ended_at IS NULL"""


async def close_wait(conn: Db, job_id: str, attempt: int, at: datetime, ended_by: str) -> None:
    """End the attempt's current wait reason, if it has one."""
    await conn.execute(_CLOSE_WAIT, job_id, attempt, at, ended_by)


async def close_waits(conn: Db, ended: Sequence[WaitEnd]) -> None:
    """End these attempts' current wait reasons, where they have one (one round trip for all)."""
    if ended:
        await conn.executemany(_CLOSE_WAIT, [(e.job_id, e.attempt, e.at, e.ended_by) for e in ended])


async def record_waits(conn: Db, updates: Sequence[WaitUpdate]) -> None:
    """Open a new reason for each attempt whose reason changed, refresh the details of the others' open one.

    Each kind of write is one statement for the whole round (pipelined), not one round trip per attempt:
    when a round places some jobs, every job queued behind them moves up a place.
    """
    opened = [u for u in updates if u.changed]
    await close_waits(
        conn, [WaitEnd(u.waiting.gang.job_id, u.waiting.gang.attempt, u.at, str(u.waiting.reason)) for u in opened]
    )
    if opened:
        await conn.executemany(
            """INSERT INTO scheduler_waits (job_id, attempt, started_seq, reason, detail, owner_lane, blocking, figures,
                                            queue_position, started_at)
               VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8::jsonb, $9, $10)""",
            [
                (
                    u.waiting.gang.job_id,
                    u.waiting.gang.attempt,
                    u.seq,
                    u.waiting.reason.value,
                    u.waiting.detail,
                    u.waiting.owner_lane.value,
                    *_blocking_and_figures(u.waiting),
                    u.waiting.queue_position,
                    u.at,
                )
                for u in opened
            ],
        )
    refreshed = [u.waiting for u in updates if not u.changed]
    if refreshed:
        await conn.executemany(
            """UPDATE scheduler_waits SET detail = $3, blocking = $4::jsonb, figures = $5::jsonb, queue_position = $6
               WHERE job_id = $1 AND attempt = $2 AND ended_at IS NULL""",
            [(w.gang.job_id, w.gang.attempt, w.detail, *_blocking_and_figures(w), w.queue_position) for w in refreshed],
        )


def _blocking_and_figures(waiting: Waiting) -> tuple[str, str]:
    return json.dumps([b.model_dump(mode="json") for b in waiting.blocking]), json.dumps(dict(waiting.figures))


async def wait_history(conn: Db, job_id: str) -> list[dict[str, Any]]:
    """Every reason the job's attempts waited for, oldest first, with the time spent in each."""
    rows = await conn.fetch(
        """SELECT attempt, reason, detail, owner_lane, blocking, figures, queue_position, started_at, ended_at,
                  ended_by, extract(epoch FROM coalesce(ended_at, now()) - started_at) AS seconds
           FROM scheduler_waits WHERE job_id = $1 ORDER BY attempt, started_seq""",
        job_id,
    )
    return [
        {
            "attempt": r["attempt"],
            "reason": r["reason"],
            "detail": r["detail"],
            "owner_lane": r["owner_lane"],
            "blocking": json.loads(r["blocking"]),
            "figures": json.loads(r["figures"]),
            "queue_position": r["queue_position"],
            "since": r["started_at"].isoformat(),
            "until": r["ended_at"].isoformat() if r["ended_at"] else None,
            "ended_by": r["ended_by"],
            "seconds": round(float(r["seconds"]), 6),
        }
        for r in rows
    ]


async def releases(conn: Db, job_id: str) -> list[dict[str, Any]]:
    """The release requests of a job and their outcomes."""
    rows = await conn.fetch(
        "SELECT attempt, cause_id, outcome, gpus, at FROM scheduler_releases WHERE job_id = $1 ORDER BY at, cause_id",
        job_id,
    )
    return [{**dict(r), "at": r["at"].isoformat()} for r in rows]
