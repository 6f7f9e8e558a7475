"""The scheduler's side of `lanes job <id> --json`: each wait reason with its time, and the releases."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import asyncpg

from lanes_contract.jobs import JobState
from lanes_lifecycle import views as lifecycle
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
    row names the job, attempt, nodes, GPU count and why. Read through the two services' views (the
    scheduler's holdings, the lifecycle's jobs), never their tables.
    """
    try:
        held = await scheduler.holdings(conn)
        held_jobs = sorted({holding.holder.rpartition("/")[0] for holding in held})
        jobs = {job["job_id"]: job for job in await lifecycle.list_jobs(conn, job_ids=held_jobs)}
    except asyncpg.UndefinedTableError:
        return []
    by_attempt: dict[tuple[str, int], tuple[set[str], int]] = {}
    for holding in held:
        job_id, _, number = holding.holder.rpartition("/")
        nodes, gpus = by_attempt.get((job_id, int(number)), (set(), 0))
        by_attempt[job_id, int(number)] = (nodes | {holding.node}, gpus + len(holding.gpus))
    leaks = []
    for (job_id, attempt), (nodes, gpus) in sorted(by_attempt.items()):
        job = jobs.get(job_id)
        if job is None:
            why = "the lifecycle knows no such job"
        elif job["state"] == JobState.RELEASED:
            why = "the job is released"
        elif job["attempt"] > attempt:
            why = f"the job is on attempt {job['attempt']}"
        else:
            continue
        leaks.append({"job_id": job_id, "attempt": attempt, "nodes": sorted(nodes), "gpus": gpus, "why": why})
    return leaks


async def nodes_known(conn: Db, node_ids: Collection[str] | None = None) -> int:
    """How many of these nodes (all when None) the scheduler's inventory holds: it has read their registration."""
    inventory = {node.node_id for node in await scheduler.nodes(conn)}
    return len(inventory if node_ids is None else inventory & set(node_ids))
