"""The lifecycle's PostgreSQL projection of job views."""

from __future__ import annotations

from lanes_common.store import Db
from lanes_lifecycle.domain.job import JobView


async def load(conn: Db, job_id: str, *, for_update: bool = False) -> JobView | None:
    """The current view of a job, locked for the transaction when `for_update`."""
    lock = " FOR UPDATE" if for_update else ""
    raw = await conn.fetchval(f"SELECT view FROM lifecycle_jobs WHERE job_id = $1{lock}", job_id)  # noqa: S608 - constant suffix
    return None if raw is None else JobView.model_validate_json(raw)


async def save(conn: Db, view: JobView) -> None:
    """Store a job's view (insert or replace)."""
    await conn.execute(
        """INSERT INTO lifecycle_jobs (job_id, state, attempt, view) VALUES ($1, $2, $3, $4::jsonb)
           ON CONFLICT (job_id) DO UPDATE SET state = EXCLUDED.state, attempt = EXCLUDED.attempt,
               view = EXCLUDED.view, updated_at = now()""",
        view.job_id,
        view.state.value,
        view.current.number,
        view.model_dump_json(),
    )
