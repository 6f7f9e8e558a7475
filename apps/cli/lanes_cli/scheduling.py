"""The scheduler's side of `lanes job <id> --json`: each wait reason with its time, and the releases."""

from __future__ import annotations

from typing import Any

import asyncpg

from lanes_runtime.store import Db
from lanes_scheduler import views as scheduler


async def scheduling_view(conn: Db, job_id: str) -> dict[str, Any]:
    """Wait history (reason, detail, blocking resources, owner lane, since/until, seconds) and totals per reason.

    Empty when no scheduler has run against this database.
    """
    try:
        history = await scheduler.wait_history(conn, job_id)
        releases = await scheduler.releases(conn, job_id)
    except asyncpg.UndefinedTableError:
        return {}
    seconds_in_reason: dict[str, float] = {}
    for wait in history:
        seconds_in_reason[wait["reason"]] = round(seconds_in_reason.get(wait["reason"], 0.0) + wait["seconds"], 6)
    current = next((w for w in reversed(history) if w["until"] is None), None)
    return {
        "wait_reason": current,
        "wait_history": history,
        "seconds_in_reason": seconds_in_reason,
        "releases": releases,
    }


async def leaked_allocations(conn: Db) -> list[dict[str, Any]]:
    """GPUs the scheduler still holds for job attempts that are over.

    Over means: the lifecycle knows no such job, has released it, or has moved it to a later attempt. Each
    row names the job, attempt, nodes, GPU count and why.
    """
    try:
        rows = await conn.fetch(
            """SELECT a.job_id, a.attempt, array_agg(DISTINCT a.node_id ORDER BY a.node_id) AS nodes,
                      count(*) AS gpus, l.state, l.attempt AS current_attempt
               FROM scheduler_allocations a LEFT JOIN lifecycle_jobs l USING (job_id)
               GROUP BY a.job_id, a.attempt, l.state, l.attempt
               HAVING l.state IS NULL OR l.state = 'released' OR l.attempt > a.attempt
               ORDER BY a.job_id, a.attempt"""
        )
    except asyncpg.UndefinedTableError:
        return []
    leaks = []
    for row in rows:
        if row["state"] is None:
            why = "the lifecycle knows no such job"
        elif row["state"] == "released":
            why = "the job is released"
        else:
            why = f"the job is on attempt {row['current_attempt']}"
        leaks.append(
            {
                "job_id": row["job_id"],
                "attempt": row["attempt"],
                "nodes": list(row["nodes"]),
                "gpus": row["gpus"],
                "why": why,
            }
        )
    return leaks
