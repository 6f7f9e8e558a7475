"""The lifecycle's PostgreSQL projection: job views, their attempts, rank processes and state spans.

The folded view (JSON) is what the fold reads back; the other tables are written from it on every save so
that `lanes jobs`, `lanes job` and SQL users can query attempts, ranks and time in state directly. Table
names are unqualified on purpose: a rebuild writes the same rows into a scratch schema via search_path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lanes_lifecycle.domain.job import JobView
from lanes_runtime.store import Db

PROJECTION_TABLES = ("lifecycle_jobs", "lifecycle_attempts", "lifecycle_ranks", "lifecycle_state_spans")


async def load(conn: Db, job_id: str, *, for_update: bool = False) -> JobView | None:
    """The current view of a job, locked for the transaction when `for_update`."""
    view, _ = await load_with_seq(conn, job_id, for_update=for_update)
    return view


async def load_with_seq(conn: Db, job_id: str, *, for_update: bool = False) -> tuple[JobView | None, int]:
    """The view and the stream sequence of the job's last published state change (0: none yet)."""
    lock = " FOR UPDATE" if for_update else ""
    row = await conn.fetchrow(f"SELECT view, transition_seq FROM lifecycle_jobs WHERE job_id = $1{lock}", job_id)  # noqa: S608 - constant suffix
    if row is None:
        return None, 0
    return JobView.model_validate_json(row["view"]), int(row["transition_seq"])


async def load_many(conn: Db, job_ids: Sequence[str]) -> dict[str, tuple[JobView, int]]:
    """The views (and last transition sequences) of these jobs that exist, locked for the transaction.

    Rows are locked in job id order, as every batch locks them, so two transactions never deadlock.
    """
    rows = await conn.fetch(
        """SELECT job_id, view, transition_seq FROM lifecycle_jobs WHERE job_id = ANY($1::text[])
           ORDER BY job_id FOR UPDATE""",
        sorted(set(job_ids)),
    )
    return {row["job_id"]: (JobView.model_validate_json(row["view"]), int(row["transition_seq"])) for row in rows}


async def save(conn: Db, view: JobView, *, transition_seq: int | None = None) -> None:
    """Store a job's view and its query rows (insert or replace); keep `transition_seq` unless given."""
    await save_many(conn, [(view, transition_seq)])


async def save_many(conn: Db, views: Sequence[tuple[JobView, int | None]]) -> None:
    """Store job views and their query rows, seven statements however many jobs (a batch's changes at once).

    Each view's `transition_seq` is kept when None. The query rows are replaced: deleted, then inserted.
    """
    if not views:
        return
    job_ids = [view.job_id for view, _ in views]
    await conn.executemany(
        """INSERT INTO lifecycle_jobs (job_id, state, attempt, view, transition_seq, flags)
           VALUES ($1, $2, $3, $4::jsonb, coalesce($5, 0), $6)
           ON CONFLICT (job_id) DO UPDATE SET state = EXCLUDED.state, attempt = EXCLUDED.attempt,
               view = EXCLUDED.view, transition_seq = coalesce($5, lifecycle_jobs.transition_seq),
               flags = EXCLUDED.flags, updated_at = now()""",
        [
            (
                view.job_id,
                view.state.value,
                view.current.number,
                view.model_dump_json(),
                transition_seq,
                [flag.value for flag in view.flags],
            )
            for view, transition_seq in views
        ],
    )
    for table in ("lifecycle_ranks", "lifecycle_attempts", "lifecycle_state_spans"):
        await conn.execute(f"DELETE FROM {table} WHERE job_id = ANY($1::text[])", job_ids)  # noqa: S608 - constant names
    await conn.executemany(
        """INSERT INTO lifecycle_attempts (job_id, attempt, state, nodes, requested_at, started_at, ended_at, cause,
               cause_detail, last_checkpoint_step, lost_steps, released)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)""",
        [
            (
                view.job_id,
                a.number,
                a.state.value,
                list(dict.fromkeys(p.node for p in a.placement)),
                a.requested_at,
                a.started_at,
                a.ended_at,
                a.cause.value if a.cause else None,
                a.cause_detail,
                a.last_checkpoint.step if a.last_checkpoint else None,
                a.lost_steps,
                a.released,
            )
            for view, _ in views
            for a in view.attempts
        ],
    )
    await conn.executemany(
        """INSERT INTO lifecycle_ranks (job_id, attempt, rank, node, state, pid, exit_code, signal)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8)""",
        [
            (view.job_id, a.number, r.rank, r.node, r.state, r.pid, r.exit_code, r.signal)
            for view, _ in views
            for a in view.attempts
            for r in a.ranks.values()
        ],
    )
    await conn.executemany(
        """INSERT INTO lifecycle_state_spans (job_id, position, state, attempt, entered_at, left_at, cause_type,
               cause_id, reason) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)""",
        [
            (
                view.job_id,
                i,
                s.state.value,
                s.attempt,
                s.entered_at,
                view.history[i + 1].entered_at if i + 1 < len(view.history) else None,
                s.cause_type,
                s.cause_id,
                s.reason,
            )
            for view, _ in views
            for i, s in enumerate(view.history)
        ],
    )


async def list_jobs(conn: Db, *, states: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Jobs with their state, flags and current attempt, newest change first; all states when none given."""
    rows = await conn.fetch(
        """SELECT j.job_id, j.state, j.attempt, j.flags, j.updated_at, j.view -> 'spec' ->> 'name' AS name,
                  a.cause, a.cause_detail
           FROM lifecycle_jobs j LEFT JOIN lifecycle_attempts a ON a.job_id = j.job_id AND a.attempt = j.attempt
           WHERE cardinality($1::text[]) = 0 OR j.state = ANY($1::text[])
           ORDER BY j.updated_at DESC, j.job_id""",
        list(states),
    )
    return [
        {
            "job_id": r["job_id"],
            "name": r["name"],
            "state": r["state"],
            "flags": list(r["flags"]),
            "attempt": r["attempt"],
            "cause": r["cause"],
            "cause_detail": r["cause_detail"],
            "updated_at": r["updated_at"].isoformat(),
        }
        for r in rows
    ]
