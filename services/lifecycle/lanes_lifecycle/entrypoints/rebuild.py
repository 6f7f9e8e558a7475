"""Rebuilding the lifecycle projection from the log, and checking it against the live one.

The log is the source of truth (docs/architecture.md): replaying LANES_JOBS through the same pure fold into a scratch
schema must give exactly the rows the live service wrote. Bookkeeping that is not state (when a row was
last written, the JetStream sequence of the last published transition) is left out of the comparison.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from lanes_contract.codec import decode
from lanes_contract.errors import DecodeError
from lanes_contract.streams import JOBS
from lanes_lifecycle.adapters import repository
from lanes_lifecycle.adapters.repository import PROJECTION_TABLES
from lanes_lifecycle.domain.job import IllegalTransitionError, JobView, evolve
from lanes_lifecycle.entrypoints.service import LIFECYCLE_INPUTS, SERVICE
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.store import Db

NOT_STATE = ("updated_at", "transition_seq", "revision")
"""Bookkeeping columns: when and under which token a row was written, where its chain stood on the log."""
_KEYS = {
    "lifecycle_jobs": ("job_id",),
    "lifecycle_attempts": ("job_id", "attempt"),
    "lifecycle_ranks": ("job_id", "attempt", "rank"),
    "lifecycle_state_spans": ("job_id", "position"),
}


@dataclass(frozen=True)
class Difference:
    """One row that differs between the live projection and the rebuild (None: the row is missing)."""

    table: str
    key: str
    live: dict[str, Any] | None
    rebuilt: dict[str, Any] | None


async def fold_log(js: JetStreamContext) -> tuple[dict[str, JobView], int]:
    """Every job view folded from LANES_JOBS, and how many events were folded.

    Rejected events are skipped, as the live service skips them; undecodable ones too, as the live service
    dead-letters them.
    """
    views: dict[str, JobView] = {}
    folded = 0
    inputs = frozenset(LIFECYCLE_INPUTS)
    async for msg in iter_stream(js, Selection(JOBS.name, "lanes.job.>")):
        if msg.subject.rsplit(".", 1)[-1] not in inputs:
            continue
        try:
            event = decode(msg.subject, msg.headers, msg.data)
        except DecodeError:
            continue
        job_id = event.job_key
        try:
            views[job_id], _ = evolve(views.get(job_id), event)
        except IllegalTransitionError:
            continue
        folded += 1
    return views, folded


async def rebuild_into(conn: Db, schema: str, views: dict[str, JobView]) -> None:
    """Create `schema` afresh with the lifecycle's tables and write the views into it."""
    assert SERVICE.migrations is not None  # noqa: S101 - the lifecycle ships its migrations
    quoted = _ident(schema)
    await conn.execute(f"DROP SCHEMA IF EXISTS {quoted} CASCADE")
    await conn.execute(f"CREATE SCHEMA {quoted}")
    scripts = sorted((e.name, e.read_text()) for e in SERVICE.migrations.iterdir() if e.name.endswith(".sql"))
    async with conn.transaction():
        await conn.execute(f"SET LOCAL search_path TO {quoted}")
        for _, sql in scripts:
            await conn.execute(sql)
        for view in views.values():
            await repository.save(conn, view)


async def diff_schemas(conn: Db, live: str, rebuilt: str) -> list[Difference]:
    """Rows of the lifecycle tables that differ between two schemas, state columns only."""
    differences: list[Difference] = []
    drop = " ".join(f"- '{column}'" for column in NOT_STATE)
    for table in PROJECTION_TABLES:
        rows: list[dict[str, dict[str, Any]]] = []
        for schema in (live, rebuilt):
            fetched = await conn.fetch(f"SELECT to_jsonb(t) {drop} AS row FROM {_ident(schema)}.{table} t")  # noqa: S608 - identifiers quoted
            decoded = [json.loads(r["row"]) for r in fetched]
            rows.append({"/".join(str(d[k]) for k in _KEYS[table]): d for d in decoded})
        live_rows, rebuilt_rows = rows
        differences.extend(
            Difference(table, key, live_rows.get(key), rebuilt_rows.get(key))
            for key in sorted(live_rows.keys() | rebuilt_rows.keys())
            if live_rows.get(key) != rebuilt_rows.get(key)
        )
    return differences


async def live_schema(conn: Db) -> str:
    """The schema that holds the live lifecycle projection."""
    schema = await conn.fetchval(
        """SELECT table_schema FROM information_schema.tables WHERE table_name = 'lifecycle_jobs'
           AND table_schema = ANY(current_schemas(false)) LIMIT 1"""
    )
    if schema is None:
        msg = "no lifecycle projection here: no lifecycle service has run against this database"
        raise LookupError(msg)
    return str(schema)


async def verify(js: JetStreamContext, pool: asyncpg.Pool, *, schema: str, keep: bool) -> tuple[int, list[Difference]]:
    """Rebuild into `schema`, diff against the live projection; drop the scratch schema unless `keep`."""
    views, folded = await fold_log(js)
    async with pool.acquire() as conn:
        live = await live_schema(conn)
        try:
            await rebuild_into(conn, schema, views)
            return folded, await diff_schemas(conn, live, schema)
        finally:
            if not keep:
                await conn.execute(f"DROP SCHEMA IF EXISTS {_ident(schema)} CASCADE")


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
