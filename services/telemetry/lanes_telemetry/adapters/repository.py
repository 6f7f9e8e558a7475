"""Telemetry's tables: placements (its own copy), evidence, reporters and findings. Plain SQL on one connection."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from lanes_contract.events import (
    EvidenceCategory,
    EvidenceData,
    JobFindingData,
    JobSlowdownData,
    RankAssignment,
    StepTiming,
)
from lanes_evidence.evidence import Evidence
from lanes_runtime.store import Db
from lanes_telemetry.domain.settlement import RankExit
from lanes_telemetry.service_layer.ports import (
    NewEvidence,
    Placement,
    PlacementSpan,
    Reporter,
    StoredEvidence,
    TimedStep,
)

NO_RANK = -1
"""The rank column of node-level evidence in `telemetry_reporters` (a primary key cannot hold NULL)."""


def _stored(row: Any) -> StoredEvidence:
    data = EvidenceData.model_validate_json(row["data"])
    return StoredEvidence(
        row["event_id"], row["lane"], Evidence(data, row["time"], row["node"], row["rank"], row["event_id"])
    )


@dataclass(frozen=True)
class DueWindow:
    """A settle window that ran out and whose end is not yet on the log."""

    job_id: str
    attempt: int
    ended_at: datetime
    window_s: float


async def due_windows(conn: Db | asyncpg.Pool, now: datetime, limit: int = 100) -> list[DueWindow]:
    """Settle windows past their end that no consumer has closed yet."""
    rows = await conn.fetch(
        """SELECT job_id, attempt, ended_at, window_s FROM telemetry_attempts
           WHERE NOT window_ended AND settle_due_at <= $1 ORDER BY settle_due_at LIMIT $2""",
        now,
        limit,
    )
    return [DueWindow(row["job_id"], row["attempt"], row["ended_at"], row["window_s"]) for row in rows]


class PostgresTelemetryStore:
    """The `TelemetryStore` port on one PostgreSQL connection (inside the caller's transaction)."""

    def __init__(self, conn: Db) -> None:
        self._conn = conn

    async def lock_nodes(self, nodes: Sequence[str], *, exclusive: bool) -> None:
        """Serialise correlation per node for this transaction (evidence vs. a placement arriving meanwhile)."""
        # One order everywhere (sorted; unnest yields an array's elements in order): no deadlock between two
        # transactions locking overlapping nodes.
        lock = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
        await self._conn.execute(
            f"SELECT {lock}(hashtext('lanes-telemetry-node'), hashtext(node)) FROM unnest($1::text[]) AS node",  # noqa: S608 - one of two function names
            sorted(set(nodes)),
        )

    async def lock_attempt(self, job_id: str, attempt: int) -> None:
        """Serialise elections of one attempt, so two replicas never publish the same finding version twice."""
        await self._conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext($1), $2)", f"lanes-telemetry-job:{job_id}", attempt
        )

    async def save_placement(
        self, job_id: str, attempt: int, assignments: Sequence[RankAssignment], placed_at: datetime
    ) -> None:
        """Record where each rank of an attempt runs (a replayed placement overwrites itself)."""
        await self._conn.executemany(
            """INSERT INTO telemetry_placements (job_id, attempt, rank, node, gpus, placed_at)
               VALUES ($1, $2, $3, $4, $5, $6)
               ON CONFLICT (job_id, attempt, rank) DO UPDATE SET node = EXCLUDED.node, gpus = EXCLUDED.gpus,
                   placed_at = EXCLUDED.placed_at""",
            [(job_id, attempt, a.rank, a.node, list(a.gpus), placed_at) for a in assignments],
        )

    async def release(self, job_id: str, attempt: int | None, released_at: datetime) -> None:
        """Mark an attempt's placement as ended: later evidence on its nodes is no longer its evidence."""
        await self._conn.execute(
            """UPDATE telemetry_placements SET released_at = $3
               WHERE job_id = $1 AND ($2::integer IS NULL OR attempt = $2) AND released_at IS NULL""",
            job_id,
            attempt,
            released_at,
        )

    async def placement_at(self, node: str, at: datetime, skew: timedelta) -> Placement | None:
        """The latest attempt placed on `node` no later than `at` (+ skew) and not released before it."""
        rows = await self._conn.fetch(
            """WITH latest AS (
                   SELECT job_id, attempt FROM telemetry_placements
                   WHERE node = $1 AND placed_at <= $2::timestamptz + $3::interval
                     AND (released_at IS NULL OR released_at >= $2::timestamptz - $3::interval)
                   ORDER BY placed_at DESC LIMIT 1)
               SELECT p.job_id, p.attempt, p.rank FROM telemetry_placements p JOIN latest USING (job_id, attempt)
               WHERE p.node = $1 ORDER BY p.rank""",
            node,
            at,
            skew,
        )
        if not rows:
            return None
        return Placement(rows[0]["job_id"], rows[0]["attempt"], tuple(row["rank"] for row in rows))

    async def world_of(self, job_id: str, attempt: int) -> dict[int, str | None]:
        """Every rank of the attempt with its node."""
        rows = await self._conn.fetch(
            "SELECT rank, node FROM telemetry_placements WHERE job_id = $1 AND attempt = $2", job_id, attempt
        )
        return {row["rank"]: row["node"] for row in rows}

    async def world_size(self, job_id: str, attempt: int) -> int:
        """How many ranks the attempt has."""
        count = await self._conn.fetchval(
            "SELECT count(*) FROM telemetry_placements WHERE job_id = $1 AND attempt = $2", job_id, attempt
        )
        return int(count)

    async def save_evidence(self, items: Sequence[NewEvidence]) -> None:
        """Store pieces of evidence in one pipelined statement (a redelivered one is left as it is)."""
        await self._conn.executemany(
            """INSERT INTO telemetry_evidence
                   (event_id, node, kind, category, time, lane, job_id, attempt, rank, data, stream_seq)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, $11) ON CONFLICT (event_id) DO NOTHING""",
            [
                (
                    item.event_id,
                    item.node,
                    item.evidence.kind,
                    item.evidence.category.value,
                    item.evidence.time,
                    item.lane,
                    item.job_id,
                    item.attempt,
                    item.evidence.rank,
                    item.evidence.data.model_dump_json(exclude_defaults=True),
                    item.stream_seq,
                )
                for item in items
            ],
        )

    async def add_reporters(self, job_id: str, attempt: int, reporters: Sequence[Reporter]) -> tuple[int, int]:
        """Record that these (node, rank) reported for the attempt; its number of reporters before and after."""
        unique = list(dict.fromkeys((node, NO_RANK if rank is None else rank) for node, rank in reporters))
        # The outer count reads the table as it was before the CTE's insert (one snapshot per statement).
        row = await self._conn.fetchrow(
            """WITH added AS (
                   INSERT INTO telemetry_reporters (job_id, attempt, node, rank)
                   SELECT $1, $2, node, rank FROM unnest($3::text[], $4::integer[]) AS r(node, rank)
                   ON CONFLICT DO NOTHING RETURNING 1)
               SELECT (SELECT count(*) FROM telemetry_reporters WHERE job_id = $1 AND attempt = $2) AS before,
                      (SELECT count(*) FROM added) AS added""",
            job_id,
            attempt,
            [node for node, _ in unique],
            [rank for _, rank in unique],
        )
        assert row is not None  # noqa: S101 - a SELECT of two aggregates returns one row
        return int(row["before"]), int(row["before"]) + int(row["added"])

    async def count_consequences(self, added: Mapping[tuple[str, int, str], int]) -> dict[tuple[str, int, str], int]:
        """Add to the consequences counted per (job, attempt, category); return how many were counted before.

        One statement; its rows are locked in key order, so that two transactions adding to overlapping
        counters wait for each other rather than deadlock, and each counts on from the other's commit.
        """
        keys = sorted(added)
        rows = await self._conn.fetch(
            """INSERT INTO telemetry_consequences AS c (job_id, attempt, category, counted)
               SELECT j, a, k, n FROM unnest($1::text[], $2::integer[], $3::text[], $4::integer[])
                   WITH ORDINALITY AS t(j, a, k, n, o) ORDER BY o
               ON CONFLICT (job_id, attempt, category) DO UPDATE SET counted = c.counted + EXCLUDED.counted
               RETURNING job_id, attempt, category, counted""",
            [job for job, _, _ in keys],
            [attempt for _, attempt, _ in keys],
            [category for _, _, category in keys],
            [added[key] for key in keys],
        )
        after = {(row["job_id"], int(row["attempt"]), row["category"]): int(row["counted"]) for row in rows}
        return {key: after[key] - added[key] for key in keys}

    async def correlate_late(
        self, job_id: str, attempt: int, ranks_by_node: dict[str, tuple[int, ...]], since: datetime
    ) -> list[StoredEvidence]:
        """Attach evidence that arrived before the placement did (but happened after it) to the attempt."""
        correlated: list[StoredEvidence] = []
        for node, ranks in sorted(ranks_by_node.items()):
            rows = await self._conn.fetch(
                """UPDATE telemetry_evidence SET job_id = $1, attempt = $2, rank = COALESCE(rank, $3)
                   WHERE node = $4 AND job_id IS NULL AND time >= $5
                     AND NOT EXISTS (SELECT 1 FROM telemetry_shared_evidence AS shared
                                     WHERE shared.event_id = telemetry_evidence.event_id)
                   RETURNING event_id, lane, node, rank, time, data""",
                job_id,
                attempt,
                ranks[0] if len(ranks) == 1 else None,
                node,
                since,
            )
            correlated.extend(_stored(row) for row in rows)
        return correlated

    async def evidence_of(self, job_id: str, attempt: int, *, ignored: Sequence[str]) -> list[Evidence]:
        """The attempt's evidence the election reads (categories in `ignored` are left out)."""
        rows = await self._conn.fetch(
            """SELECT event_id, lane, node, rank, time, data FROM telemetry_evidence
               WHERE job_id = $1 AND attempt = $2 AND category <> ALL($3::text[])""",
            job_id,
            attempt,
            list(ignored),
        )
        return [_stored(row).evidence for row in rows]

    async def count_evidence(self, job_id: str, attempt: int, *, ignored: Sequence[str], up_to: int) -> int:
        """How much evidence the attempt has for the election, counted no further than `up_to` + 1."""
        count = await self._conn.fetchval(
            """SELECT count(*) FROM (SELECT 1 FROM telemetry_evidence
                   WHERE job_id = $1 AND attempt = $2 AND category <> ALL($3::text[]) LIMIT $4) AS elected""",
            job_id,
            attempt,
            list(ignored),
            up_to + 1,
        )
        return int(count)

    async def load_finding(self, job_id: str, attempt: int) -> tuple[int, dict[str, Any]] | None:
        """The latest finding's version and JSON body, if any."""
        row = await self._conn.fetchrow(
            "SELECT version, finding FROM telemetry_findings WHERE job_id = $1 AND attempt = $2", job_id, attempt
        )
        return None if row is None else (int(row["version"]), json.loads(row["finding"]))

    async def save_finding(self, job_id: str, attempt: int, finding: JobFindingData) -> None:
        """Store the latest finding of an attempt."""
        first = finding.first_error
        await self._conn.execute(
            """INSERT INTO telemetry_findings (job_id, attempt, version, finding, first_node, first_lane)
               VALUES ($1, $2, $3, $4::jsonb, $5, $6)
               ON CONFLICT (job_id, attempt) DO UPDATE SET version = EXCLUDED.version, finding = EXCLUDED.finding,
                   first_node = EXCLUDED.first_node, first_lane = EXCLUDED.first_lane, updated_at = now()""",
            job_id,
            attempt,
            finding.version,
            finding.model_dump_json(),
            first.node if first else None,
            first.lane.value if first else None,
        )

    async def other_jobs_first_error_on(self, node: str, job_id: str) -> int:
        """How many other jobs elected a host or network first error on this node (a repeat offender to drain)."""
        count = await self._conn.fetchval(
            """SELECT count(DISTINCT job_id) FROM telemetry_findings
               WHERE first_node = $1 AND job_id <> $2 AND first_lane IN ('host', 'network')""",
            node,
            job_id,
        )
        return int(count)

    async def placement_spans(
        self, nodes: Sequence[str], since: datetime, until: datetime
    ) -> dict[str, list[PlacementSpan]]:
        """Each node's ranks placed by `until` and not released before `since` (every node a key)."""
        rows = await self._conn.fetch(
            """SELECT node, job_id, attempt, rank, placed_at, released_at FROM telemetry_placements
               WHERE node = ANY($1::text[]) AND placed_at <= $3 AND (released_at IS NULL OR released_at >= $2)""",
            list(nodes),
            since,
            until,
        )
        spans: dict[str, list[PlacementSpan]] = {node: [] for node in nodes}
        for row in rows:
            spans[row["node"]].append(
                PlacementSpan(row["job_id"], row["attempt"], row["rank"], row["placed_at"], row["released_at"])
            )
        return spans

    async def process_of_pid(self, node: str, pid: int, candidates: Sequence[Placement]) -> tuple[str, int, int] | None:
        """The (job, attempt, rank) among `candidates` whose process on `node` had this pid."""
        for placement in candidates:
            rank = await self._conn.fetchval(
                "SELECT rank FROM telemetry_processes WHERE job_id = $1 AND attempt = $2 AND node = $3 AND pid = $4",
                placement.job_id,
                placement.attempt,
                node,
                pid,
            )
            if rank is not None:
                return placement.job_id, placement.attempt, int(rank)
        return None

    async def save_started(self, job_id: str, attempt: int, rank: int, node: str | None, pid: int) -> None:
        """Record a rank's pid (kernel lines name pids)."""
        await self._conn.execute(
            """INSERT INTO telemetry_processes (job_id, attempt, rank, node, pid) VALUES ($1, $2, $3, $4, $5)
               ON CONFLICT (job_id, attempt, rank) DO UPDATE SET pid = EXCLUDED.pid, node = EXCLUDED.node""",
            job_id,
            attempt,
            rank,
            node,
            pid,
        )

    async def save_exit(self, job_id: str, attempt: int, ex: RankExit) -> None:
        """Record how a rank ended (a redelivered exit overwrites itself)."""
        await self._conn.execute(
            """INSERT INTO telemetry_processes
                   (job_id, attempt, rank, node, exit_code, signal, evidence_count, exited, exited_at, exit_event_id)
               VALUES ($1, $2, $3, $4, $5, $6, $7, true, $8, $9)
               ON CONFLICT (job_id, attempt, rank) DO UPDATE
               SET node = COALESCE(EXCLUDED.node, telemetry_processes.node),
                   exit_code = EXCLUDED.exit_code, signal = EXCLUDED.signal, evidence_count = EXCLUDED.evidence_count,
                   exited = true, exited_at = EXCLUDED.exited_at, exit_event_id = EXCLUDED.exit_event_id""",
            job_id,
            attempt,
            ex.rank,
            ex.node,
            ex.exit_code,
            ex.signal,
            ex.evidence,
            ex.time,
            ex.id,
        )

    async def exits_of(self, job_id: str, attempt: int) -> dict[int, RankExit]:
        """The attempt's rank exits seen so far."""
        rows = await self._conn.fetch(
            """SELECT rank, node, pid, exit_code, signal, evidence_count, exited_at, exit_event_id
               FROM telemetry_processes WHERE job_id = $1 AND attempt = $2 AND exited""",
            job_id,
            attempt,
        )
        return {
            row["rank"]: RankExit(
                rank=row["rank"],
                node=row["node"],
                exit_code=row["exit_code"],
                signal=row["signal"],
                time=row["exited_at"],
                evidence=row["evidence_count"],
                id=row["exit_event_id"] or "",
                pid=row["pid"],
            )
            for row in rows
        }

    async def heard_per_rank(self, job_id: str, attempt: int) -> dict[int, int]:
        """How many evidence items arrived from each rank of the attempt."""
        rows = await self._conn.fetch(
            """SELECT rank, count(*) AS n FROM telemetry_evidence
               WHERE job_id = $1 AND attempt = $2 AND rank IS NOT NULL GROUP BY rank""",
            job_id,
            attempt,
        )
        return {row["rank"]: int(row["n"]) for row in rows}

    async def attempt_ended(self, job_id: str, attempt: int, ended_at: datetime, window: timedelta) -> None:
        """Start a failed attempt's settle window (the first end seen counts; a redelivery changes nothing)."""
        await self._conn.execute(
            """INSERT INTO telemetry_attempts (job_id, attempt, ended_at, settle_due_at, window_s)
               VALUES ($1, $2, $3, $4, $5) ON CONFLICT (job_id, attempt) DO NOTHING""",
            job_id,
            attempt,
            ended_at,
            ended_at + window,
            window.total_seconds(),
        )

    async def end_window(self, job_id: str, attempt: int) -> None:
        """The attempt's settle window ran out: its finding settles on what arrived."""
        await self._conn.execute(
            "UPDATE telemetry_attempts SET window_ended = true WHERE job_id = $1 AND attempt = $2", job_id, attempt
        )

    async def window_ended(self, job_id: str, attempt: int) -> bool:
        """Whether the attempt's settle window ran out."""
        ended = await self._conn.fetchval(
            "SELECT window_ended FROM telemetry_attempts WHERE job_id = $1 AND attempt = $2", job_id, attempt
        )
        return bool(ended)

    async def share_evidence(self, event_id: str, job_id: str, attempt: int) -> None:
        """File node-level evidence under one of the attempts that shared its node (it elects none of them)."""
        await self._conn.execute(
            """INSERT INTO telemetry_shared_evidence (event_id, job_id, attempt) VALUES ($1, $2, $3)
               ON CONFLICT DO NOTHING""",
            event_id,
            job_id,
            attempt,
        )


class PostgresStepTimings:
    """The `StepTimingStore` port on one PostgreSQL connection (inside the caller's transaction)."""

    def __init__(self, conn: Db) -> None:
        self._conn = conn

    async def add(self, job_id: str, attempt: int, rank: int, node: str, timings: Sequence[StepTiming]) -> None:
        """Keep a rank's step timings (a redelivered heartbeat writes the same rows again)."""
        await self._conn.executemany(
            """INSERT INTO telemetry_step_timings (job_id, attempt, rank, step, node, compute_s, wait_s)
               VALUES ($1, $2, $3, $4, $5, $6, $7)
               ON CONFLICT (job_id, attempt, step, rank) DO NOTHING""",
            [(job_id, attempt, rank, t.step, node, t.compute_s, t.wait_s) for t in timings],
        )

    async def placed_node(self, job_id: str, attempt: int, rank: int) -> str | None:
        """The node the rank of the attempt was placed on (None: its placement not read yet)."""
        node = await self._conn.fetchval(
            "SELECT node FROM telemetry_placements WHERE job_id = $1 AND attempt = $2 AND rank = $3",
            job_id,
            attempt,
            rank,
        )
        return None if node is None else str(node)

    async def reported(self, job_id: str, attempt: int) -> bool:
        """Whether this attempt's slowdown is already reported (once per attempt), locking the attempt's row."""
        await self._conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext($1), $2)", f"lanes-telemetry-slowdown:{job_id}", attempt
        )
        found = await self._conn.fetchval(
            "SELECT 1 FROM telemetry_slowdowns WHERE job_id = $1 AND attempt = $2", job_id, attempt
        )
        return found is not None

    async def complete_steps(self, job_id: str, attempt: int, baseline: int, recent: int) -> list[TimedStep]:
        """The attempt's first `baseline` and last `recent` steps that every placed rank reported."""
        rows = await self._conn.fetch(
            """WITH world AS (
                   SELECT count(*) AS ranks FROM telemetry_placements WHERE job_id = $1 AND attempt = $2
               ), complete AS (
                   SELECT step FROM telemetry_step_timings WHERE job_id = $1 AND attempt = $2
                   GROUP BY step HAVING count(*) = (SELECT ranks FROM world)
               ), chosen AS (
                   (SELECT step FROM complete ORDER BY step LIMIT $3)
                   UNION (SELECT step FROM complete ORDER BY step DESC LIMIT $4)
               )
               SELECT t.rank, t.step, t.node, t.compute_s, t.wait_s FROM telemetry_step_timings t
               JOIN chosen USING (step) WHERE t.job_id = $1 AND t.attempt = $2 ORDER BY t.step, t.rank""",
            job_id,
            attempt,
            baseline,
            recent,
        )
        return [TimedStep(r["rank"], r["step"], r["node"], r["compute_s"], r["wait_s"]) for r in rows]

    async def read_through(self, job_id: str, attempt: int) -> int:
        """The last step the attempt's timings were read up to (-1: none yet)."""
        found = await self._conn.fetchval(
            "SELECT read_through FROM telemetry_slowdown_reads WHERE job_id = $1 AND attempt = $2", job_id, attempt
        )
        return -1 if found is None else int(found)

    async def set_read_through(self, job_id: str, attempt: int, step: int) -> None:
        """Remember how far the attempt's timings were read."""
        await self._conn.execute(
            """INSERT INTO telemetry_slowdown_reads (job_id, attempt, read_through) VALUES ($1, $2, $3)
               ON CONFLICT (job_id, attempt) DO UPDATE SET read_through = EXCLUDED.read_through""",
            job_id,
            attempt,
            step,
        )

    async def throttled_links(self, job_id: str, attempt: int) -> list[str]:
        """The attempt's nodes whose agent reported its link holding packets back (port errors) while placed."""
        rows = await self._conn.fetch(
            """SELECT DISTINCT e.node FROM telemetry_evidence e
               JOIN telemetry_placements p ON p.node = e.node AND p.job_id = $1 AND p.attempt = $2
               WHERE ((e.job_id = $1 AND e.attempt = $2) OR e.job_id IS NULL) AND e.category = $3
                 AND e.time >= p.placed_at AND (p.released_at IS NULL OR e.time <= p.released_at)
               ORDER BY e.node""",
            job_id,
            attempt,
            EvidenceCategory.PORT_ERRORS.value,
        )
        return [str(r["node"]) for r in rows]

    async def gpus(self, job_id: str, attempt: int) -> int:
        """GPUs the attempt holds, from telemetry's copy of its placement (0 when not known)."""
        count = await self._conn.fetchval(
            "SELECT coalesce(sum(cardinality(gpus)), 0) FROM telemetry_placements WHERE job_id = $1 AND attempt = $2",
            job_id,
            attempt,
        )
        return int(count)

    async def save_report(self, job_id: str, attempt: int, report: JobSlowdownData) -> None:
        """Remember the attempt's reported slowdown (the attempt's lock is held: `reported`)."""
        await self._conn.execute(
            "INSERT INTO telemetry_slowdowns (job_id, attempt, kind, data) VALUES ($1, $2, $3, $4)",
            job_id,
            attempt,
            report.kind,
            report.model_dump_json(),
        )
