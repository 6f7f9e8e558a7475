"""The lifecycle's PostgreSQL projection: job views, their attempts, rank processes and state spans.

The folded view (JSON) is what the fold reads back; the other tables are written from it on every save so
that `lanes jobs`, `lanes job` and SQL users can query attempts, ranks and time in state directly. Table
names are unqualified on purpose: a rebuild writes the same rows into a scratch schema via search_path.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

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


class ParsedViews:
    """Views this process parsed or wrote, by job and revision, so a fold does not parse them again.

    A view is taken from here only when the row's revision is the one it was stored under. Revisions are
    random per write, so one written by another replica or by a rolled-back transaction never matches.
    Bounded: the least recently used go first.
    """

    def __init__(self, capacity: int = 1024) -> None:
        # Four folds' worth of jobs (a fold reads at most `batch`, 256); a 1,024-rank job's view is large.
        self._capacity = capacity
        self._views: OrderedDict[str, tuple[UUID, JobView]] = OrderedDict()
        self._rows: dict[str, tuple[JobView, _QueryRows]] = {}
        """The query rows last written from a held view: the next save's rows to compare with."""

    def held(self, job_id: str) -> tuple[UUID, JobView] | None:
        """The revision held for the job and its view at that revision, if any."""
        held = self._views.get(job_id)
        if held is not None:
            self._views.move_to_end(job_id)
        return held

    def put(self, job_id: str, revision: UUID, view: JobView, rows: _QueryRows | None = None) -> None:
        """Hold the job's view at `revision` (and the query rows written from it, when it was written)."""
        self._views[job_id] = (revision, view)
        self._views.move_to_end(job_id)
        if rows is None:
            self._rows.pop(job_id, None)
        else:
            self._rows[job_id] = (view, rows)
        while len(self._views) > self._capacity:
            evicted, _ = self._views.popitem(last=False)
            self._rows.pop(evicted, None)

    def rows_of(self, view: JobView) -> _QueryRows | None:
        """The query rows written from this very view (views are immutable), if they are held."""
        written = self._rows.get(view.job_id)
        return written[1] if written is not None and written[0] is view else None


async def load_many(
    conn: Db, job_ids: Sequence[str], parsed: ParsedViews | None = None
) -> dict[str, tuple[JobView, int]]:
    """The views (and last transition sequences) of these jobs that exist, locked for the transaction.

    Rows are locked in job id order, as every batch locks them, so two transactions never deadlock. A view
    `parsed` holds at the row's revision is neither sent nor parsed again.
    """
    wanted = sorted(set(job_ids))
    # Taken before the query: what the query leaves out is then at hand whatever is evicted meanwhile.
    held = {job_id: parsed.held(job_id) for job_id in wanted} if parsed else {}
    rows = await conn.fetch(
        """SELECT j.job_id, j.transition_seq, j.revision,
                  CASE WHEN j.revision = h.revision THEN NULL ELSE j.view END AS view
           FROM lifecycle_jobs j JOIN unnest($1::text[], $2::uuid[]) AS h(job_id, revision) USING (job_id)
           ORDER BY j.job_id FOR UPDATE OF j""",
        wanted,
        [kept[0] if (kept := held.get(job_id)) else None for job_id in wanted],
    )
    found = {}
    for row in rows:
        job_id, revision = row["job_id"], row["revision"]
        kept = held.get(job_id)
        if row["view"] is None and kept is not None:  # the row is at the revision held: its view is at hand
            view = kept[1]
        else:
            view = JobView.model_validate_json(row["view"])
            if parsed is not None and revision is not None:
                parsed.put(job_id, revision, view)
        found[job_id] = (view, int(row["transition_seq"]))
    return found


async def save(conn: Db, view: JobView, *, transition_seq: int | None = None) -> None:
    """Store a job's view and its query rows (insert or replace); keep `transition_seq` unless given."""
    await save_many(conn, [SavedView(view, transition_seq)])


@dataclass(frozen=True)
class SavedView:
    """A job's view to store, with the view its rows were last written from when that is known.

    `before` is the view as the transaction read it (None: the job had no rows); only the rows that differ
    from it are written. When it is not known (`known_before` False) the job's rows are all replaced.
    """

    view: JobView
    transition_seq: int | None = None
    """The sequence of the job's last state change; None keeps the stored one."""
    before: JobView | None = None
    known_before: bool = False


async def save_many(conn: Db, views: Sequence[SavedView], parsed: ParsedViews | None = None) -> None:
    """Store job views and their query rows, a few statements however many jobs (a batch's changes at once).

    The query rows (attempts, ranks, state spans) are derived from the view: a row is written only where it
    differs from what the earlier view gave, and removed where that view had it and this one has not. A fold
    that moves four of a 1,024-rank job's ranks writes four rank rows, not 1,024.
    """
    if not views:
        return
    revisions = [uuid4() for _ in views]
    await conn.executemany(
        """INSERT INTO lifecycle_jobs (job_id, state, attempt, view, transition_seq, flags, revision)
           VALUES ($1, $2, $3, $4::jsonb, coalesce($5, 0), $6, $7)
           ON CONFLICT (job_id) DO UPDATE SET state = EXCLUDED.state, attempt = EXCLUDED.attempt,
               view = EXCLUDED.view, transition_seq = coalesce($5, lifecycle_jobs.transition_seq),
               flags = EXCLUDED.flags, revision = EXCLUDED.revision, updated_at = now()""",
        [
            (
                saved.view.job_id,
                saved.view.state.value,
                saved.view.current.number,
                saved.view.model_dump_json(),
                saved.transition_seq,
                [flag.value for flag in saved.view.flags],
                revision,
            )
            for saved, revision in zip(views, revisions, strict=True)
        ],
    )
    replaced = [saved.view.job_id for saved in views if not saved.known_before]
    befores = [_rows_before(saved, parsed) for saved in views]
    afters = [_query_rows(saved.view) for saved in views]
    if parsed is not None:  # a rollback leaves these revisions on no row: they are then never matched
        for saved, revision, written_from in zip(views, revisions, afters, strict=True):
            parsed.put(saved.view.job_id, revision, saved.view, written_from)
    written: list[list[tuple[Any, ...]]] = [[] for _ in _ROW_TABLES]
    removed: list[list[tuple[Any, ...]]] = [[] for _ in _ROW_TABLES]
    for after_rows, before_rows in zip(afters, befores, strict=True):
        for index, (after, before) in enumerate(zip(after_rows, before_rows, strict=True)):
            written[index] += [row for key, row in after.items() if before.get(key) != row]
            removed[index] += [key for key in before if key not in after]
    # Ranks reference attempts: delete ranks first, insert attempts first.
    for index in reversed(range(len(_ROW_TABLES))):
        table = _ROW_TABLES[index]
        if replaced:
            await conn.execute(f"DELETE FROM {table.name} WHERE job_id = ANY($1::text[])", replaced)  # noqa: S608 - constant names
        if removed[index]:
            await conn.execute(table.delete, *map(list, zip(*removed[index], strict=True)))
    for table, rows in zip(_ROW_TABLES, written, strict=True):
        if rows:
            await conn.executemany(table.upsert, rows)


@dataclass(frozen=True)
class _RowTable:
    name: str
    upsert: str
    delete: str
    """Deletes the rows whose keys are given as one array per key column."""


_ROW_TABLES = (
    _RowTable(
        "lifecycle_attempts",
        """INSERT INTO lifecycle_attempts (job_id, attempt, state, nodes, requested_at, started_at, ended_at, cause,
               cause_detail, last_checkpoint_step, lost_steps, released)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
           ON CONFLICT (job_id, attempt) DO UPDATE SET state = EXCLUDED.state, nodes = EXCLUDED.nodes,
               requested_at = EXCLUDED.requested_at, started_at = EXCLUDED.started_at, ended_at = EXCLUDED.ended_at,
               cause = EXCLUDED.cause, cause_detail = EXCLUDED.cause_detail,
               last_checkpoint_step = EXCLUDED.last_checkpoint_step, lost_steps = EXCLUDED.lost_steps,
               released = EXCLUDED.released""",
        """DELETE FROM lifecycle_attempts WHERE (job_id, attempt) IN
               (SELECT * FROM unnest($1::text[], $2::int[]))""",
    ),
    _RowTable(
        "lifecycle_ranks",
        """INSERT INTO lifecycle_ranks (job_id, attempt, rank, node, state, pid, exit_code, signal)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
           ON CONFLICT (job_id, attempt, rank) DO UPDATE SET node = EXCLUDED.node, state = EXCLUDED.state,
               pid = EXCLUDED.pid, exit_code = EXCLUDED.exit_code, signal = EXCLUDED.signal""",
        """DELETE FROM lifecycle_ranks WHERE (job_id, attempt, rank) IN
               (SELECT * FROM unnest($1::text[], $2::int[], $3::int[]))""",
    ),
    _RowTable(
        "lifecycle_state_spans",
        """INSERT INTO lifecycle_state_spans (job_id, position, state, attempt, entered_at, left_at, cause_type,
               cause_id, reason) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
           ON CONFLICT (job_id, position) DO UPDATE SET state = EXCLUDED.state, attempt = EXCLUDED.attempt,
               entered_at = EXCLUDED.entered_at, left_at = EXCLUDED.left_at, cause_type = EXCLUDED.cause_type,
               cause_id = EXCLUDED.cause_id, reason = EXCLUDED.reason""",
        """DELETE FROM lifecycle_state_spans WHERE (job_id, position) IN
               (SELECT * FROM unnest($1::text[], $2::int[]))""",
    ),
)

_Rows = dict[tuple[Any, ...], tuple[Any, ...]]
_QueryRows = tuple[_Rows, _Rows, _Rows]
_NO_ROWS: _QueryRows = ({}, {}, {})


def _rows_before(saved: SavedView, parsed: ParsedViews | None) -> _QueryRows:
    """The rows the transaction found: those written from the view it read (derived again if not held)."""
    if not saved.known_before or saved.before is None:
        return _NO_ROWS
    held = parsed.rows_of(saved.before) if parsed is not None else None
    return held if held is not None else _query_rows(saved.before)


def _query_rows(view: JobView) -> _QueryRows:
    """The view's attempt, rank and state-span rows, each by its primary key."""
    attempts: _Rows = {}
    ranks: _Rows = {}
    for a in view.attempts:
        attempts[view.job_id, a.number] = (
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
        for r in a.ranks.values():
            ranks[view.job_id, a.number, r.rank] = (
                view.job_id,
                a.number,
                r.rank,
                r.node,
                r.state,
                r.pid,
                r.exit_code,
                r.signal,
            )
    spans: _Rows = {
        (view.job_id, i): (
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
        for i, s in enumerate(view.history)
    }
    return attempts, ranks, spans


async def list_jobs(
    conn: Db, *, states: tuple[str, ...] = (), job_ids: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Jobs with their state, flags and current attempt, newest change first (every state, every job by default)."""
    rows = await conn.fetch(
        """SELECT j.job_id, j.state, j.attempt, j.flags, j.updated_at, j.view -> 'spec' ->> 'name' AS name,
                  a.cause, a.cause_detail
           FROM lifecycle_jobs j LEFT JOIN lifecycle_attempts a ON a.job_id = j.job_id AND a.attempt = j.attempt
           WHERE (cardinality($1::text[]) = 0 OR j.state = ANY($1::text[]))
             AND ($2::text[] IS NULL OR j.job_id = ANY($2::text[]))
           ORDER BY j.updated_at DESC, j.job_id""",
        list(states),
        None if job_ids is None else list(job_ids),
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
