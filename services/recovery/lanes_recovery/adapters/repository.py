"""Recovery's PostgreSQL tables: the knowledge per job with its next timer, and the decisions it published.

Timers (a finding's grace period, a retry's backoff, a manual deadline) are rows with `next_due_at`; the
timer runner claims due jobs with `FOR UPDATE SKIP LOCKED`, so two recovery processes never fire the same
timer, and publishes through the same outbox table as the consumers (under its own consumer name).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

import asyncpg

from lanes_contract.codec import encode
from lanes_contract.events import Event, RecoveryDecided
from lanes_contract.streams import STREAM_OF_FAMILY
from lanes_recovery.domain.knowledge import JobKnowledge
from lanes_runtime.store import Db

Executor = Db | asyncpg.Pool
"""A connection, or the pool for a statement that needs no transaction."""


async def load(conn: Db, job_id: str) -> JobKnowledge | None:
    """The job's knowledge, locked for this transaction (the job's events and timers are applied one at a time)."""
    row = await conn.fetchrow("SELECT knowledge FROM recovery_jobs WHERE job_id = $1 FOR UPDATE", job_id)
    return None if row is None else JobKnowledge.model_validate_json(row["knowledge"])


async def lock_new(conn: Db, job_id: str) -> None:
    """Make sure the job has a row to lock, so two first events of one job cannot both create it."""
    await conn.execute(
        """INSERT INTO recovery_jobs (job_id, knowledge) VALUES ($1, $2::jsonb) ON CONFLICT (job_id) DO NOTHING""",
        job_id,
        JobKnowledge(job_id=job_id).model_dump_json(),
    )


async def save(conn: Db, knowledge: JobKnowledge, next_due_at: datetime | None) -> None:
    """Store the job's knowledge and its next timer."""
    await conn.execute(
        """UPDATE recovery_jobs SET knowledge = $2::jsonb, next_due_at = $3, updated_at = now() WHERE job_id = $1""",
        knowledge.job_id,
        knowledge.model_dump_json(),
        next_due_at,
    )


async def record_decision(conn: Db, decided: RecoveryDecided) -> None:
    """Keep a published decision queryable; a second policy decision for one attempt violates the unique index."""
    data = decided.data
    await conn.execute(
        """INSERT INTO recovery_decisions (decision_id, job_id, attempt, action, first_error, finding_id, policy,
               policy_version, owner, manual_action, requested_by, deadline, decided_at, decision)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14::jsonb)""",
        decided.id,
        decided.job_key,
        decided.attempt or 1,
        data.action.value,
        data.first_error,
        data.finding_id,
        data.policy,
        data.policy_version,
        data.owner,
        data.manual_action.value if data.manual_action else None,
        data.requested_by,
        data.deadline,
        decided.time,
        data.model_dump_json(),
    )


async def mark_superseded(conn: Db, decision_id: str, by: str) -> None:
    """Note that a later decision replaced this one (it stays on record)."""
    await conn.execute("UPDATE recovery_decisions SET superseded_by = $2 WHERE decision_id = $1", decision_id, by)


async def mark_escalated(conn: Db, decision_id: str, at: datetime) -> None:
    """Note that a manual decision's deadline passed and was escalated."""
    await conn.execute("UPDATE recovery_decisions SET escalated_at = $2 WHERE decision_id = $1", decision_id, at)


_CORDON_BUDGET_LOCK = 0x4C414E45_43424744
"""The transaction lock that serialises cordon budget counts (one decision counts and records at a time)."""


async def cordoned_since(conn: Db, since: datetime) -> frozenset[str]:
    """The nodes cordoned by decisions in force since `since`, under a lock held until this transaction ends.

    Decisions are rare, and each takes its job's row lock before this one (never the other way round), so
    serialising them here costs nothing and cannot deadlock.
    """
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _CORDON_BUDGET_LOCK)
    rows = await conn.fetch(
        """SELECT DISTINCT jsonb_array_elements_text(decision -> 'cordon') AS node FROM recovery_decisions
           WHERE decided_at >= $1 AND superseded_by IS NULL""",
        since,
    )
    return frozenset(row["node"] for row in rows)


async def due_jobs(conn: Executor, now: datetime, limit: int = 100) -> list[str]:
    """Jobs whose next timer has fired (not locked by another recovery process)."""
    rows = await conn.fetch(
        """SELECT job_id FROM recovery_jobs WHERE next_due_at <= $1 ORDER BY next_due_at LIMIT $2""", now, limit
    )
    return [row["job_id"] for row in rows]


async def claim_due(conn: Db, job_id: str, now: datetime) -> JobKnowledge | None:
    """Lock a due job for this transaction, or None when another process holds it or it is no longer due."""
    row = await conn.fetchrow(
        """SELECT knowledge FROM recovery_jobs WHERE job_id = $1 AND next_due_at <= $2 FOR UPDATE SKIP LOCKED""",
        job_id,
        now,
    )
    return None if row is None else JobKnowledge.model_validate_json(row["knowledge"])


async def add_to_outbox(conn: Db, consumer: str, cause_id: str, events: Sequence[Event]) -> None:
    """Store events to publish after this transaction commits (the consumers' outbox table)."""
    rows = []
    for event in events:
        encoded = encode(event)
        rows.append(
            (
                consumer,
                cause_id,
                encoded.subject,
                STREAM_OF_FAMILY[event.family].name,
                json.dumps(encoded.headers),
                encoded.payload,
            )
        )
    await conn.executemany(
        """INSERT INTO lanes_outbox (consumer, cause_id, subject, stream, headers, payload)
           VALUES ($1, $2, $3, $4, $5, $6)""",
        rows,
    )


async def outbox_rows(conn: Executor, consumer: str) -> list[tuple[int, str, dict[str, str], str, bytes]]:
    """Every unpublished outbox row of a consumer, oldest first: (id, subject, headers, stream, payload)."""
    rows = await conn.fetch(
        "SELECT id, subject, headers, stream, payload FROM lanes_outbox WHERE consumer = $1 ORDER BY id", consumer
    )
    return [(r["id"], r["subject"], json.loads(r["headers"]), r["stream"], bytes(r["payload"])) for r in rows]


async def drop_outbox_row(conn: Executor, row_id: int) -> None:
    """Forget an outbox row once its event is stored on the log."""
    await conn.execute("DELETE FROM lanes_outbox WHERE id = $1", row_id)


class PostgresRecoveryStore:
    """The `RecoveryStore` port on one PostgreSQL connection (inside the caller's transaction)."""

    def __init__(self, conn: Db) -> None:
        self._conn = conn

    async def lock_new(self, job_id: str) -> None:
        """See `RecoveryStore.lock_new`."""
        await lock_new(self._conn, job_id)

    async def load(self, job_id: str) -> JobKnowledge | None:
        """See `RecoveryStore.load`."""
        return await load(self._conn, job_id)

    async def claim_due(self, job_id: str, now: datetime) -> JobKnowledge | None:
        """See `RecoveryStore.claim_due`."""
        return await claim_due(self._conn, job_id, now)

    async def save(self, knowledge: JobKnowledge, next_due_at: datetime | None) -> None:
        """See `RecoveryStore.save`."""
        await save(self._conn, knowledge, next_due_at)

    async def record_decision(self, decided: RecoveryDecided) -> None:
        """See `RecoveryStore.record_decision`."""
        await record_decision(self._conn, decided)

    async def mark_superseded(self, decision_id: str, by: str) -> None:
        """See `RecoveryStore.mark_superseded`."""
        await mark_superseded(self._conn, decision_id, by)

    async def mark_escalated(self, decision_id: str, at: datetime) -> None:
        """See `RecoveryStore.mark_escalated`."""
        await mark_escalated(self._conn, decision_id, at)

    async def cordoned_since(self, since: datetime) -> frozenset[str]:
        """See `RecoveryStore.cordoned_since`."""
        return await cordoned_since(self._conn, since)
