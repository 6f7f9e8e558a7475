"""An in-memory `TelemetryStore` (the port telemetry's handlers take), for handler unit tests."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from lanes_contract.events import JobFindingData, Lane, RankAssignment
from lanes_evidence.evidence import Evidence
from lanes_telemetry.domain.settlement import RankExit
from lanes_telemetry.service_layer.ports import (
    NewEvidence,
    Placement,
    PlacementSpan,
    Reporter,
    StoredEvidence,
    TelemetryStore,
    placements_at,
)


@dataclass
class _Row:
    stored: StoredEvidence
    job_id: str | None
    attempt: int | None


@dataclass
class InMemoryTelemetryStore:
    """Telemetry's tables as dicts; the tests run one transaction at a time, so locks are no-ops."""

    placements: dict[tuple[str, int, int], tuple[str, datetime, datetime | None]] = field(default_factory=dict)
    evidence: dict[str, _Row] = field(default_factory=dict)
    reporters: set[tuple[str, int, str, int]] = field(default_factory=set)
    consequences: dict[tuple[str, int, str], int] = field(default_factory=dict)
    findings: dict[tuple[str, int], tuple[int, dict[str, Any], str | None]] = field(default_factory=dict)
    pids: dict[tuple[str, int, int], tuple[str | None, int]] = field(default_factory=dict)
    exits: dict[tuple[str, int, int], RankExit] = field(default_factory=dict)
    windows: dict[tuple[str, int], bool] = field(default_factory=dict)
    shared: set[tuple[str, str, int]] = field(default_factory=set)

    def __call__(self, _conn: Any) -> TelemetryStore:
        return self

    async def lock_nodes(self, nodes: Sequence[str], *, exclusive: bool) -> None:
        del nodes, exclusive

    async def lock_attempt(self, job_id: str, attempt: int) -> None:
        del job_id, attempt

    async def save_placement(
        self, job_id: str, attempt: int, assignments: Sequence[RankAssignment], placed_at: datetime
    ) -> None:
        for a in assignments:
            self.placements[job_id, attempt, a.rank] = (a.node, placed_at, None)

    async def release(self, job_id: str, attempt: int | None, released_at: datetime) -> None:
        for (job, number, rank), (node, placed, released) in list(self.placements.items()):
            if job == job_id and attempt in {None, number} and released is None:
                self.placements[job, number, rank] = (node, placed, released_at)

    async def placement_at(self, node: str, at: datetime, skew: timedelta) -> Placement | None:
        found = placements_at((await self.placement_spans([node], at - skew, at + skew))[node], at, skew)
        return found[0] if found else None

    async def placement_spans(
        self, nodes: Sequence[str], since: datetime, until: datetime
    ) -> dict[str, list[PlacementSpan]]:
        return {
            node: [
                PlacementSpan(job, number, rank, placed, released)
                for (job, number, rank), (where, placed, released) in self.placements.items()
                if where == node and placed <= until and (released is None or released >= since)
            ]
            for node in nodes
        }

    async def process_of_pid(self, node: str, pid: int, candidates: Sequence[Placement]) -> tuple[str, int, int] | None:
        for placement in candidates:
            for (job, number, rank), (where, known) in self.pids.items():
                if (job, number) == (placement.job_id, placement.attempt) and where == node and known == pid:
                    return job, number, rank
        return None

    async def world_of(self, job_id: str, attempt: int) -> dict[int, str | None]:
        return {
            rank: node
            for (job, number, rank), (node, _, _) in self.placements.items()
            if (job, number) == (job_id, attempt)
        }

    async def world_size(self, job_id: str, attempt: int) -> int:
        return len(await self.world_of(job_id, attempt))

    async def save_evidence(self, items: Sequence[NewEvidence]) -> None:
        for item in items:
            stored = StoredEvidence(item.event_id, item.lane, item.evidence)
            self.evidence.setdefault(item.event_id, _Row(stored, item.job_id, item.attempt))

    async def add_reporters(self, job_id: str, attempt: int, reporters: Sequence[Reporter]) -> tuple[int, int]:
        before = sum(1 for r in self.reporters if r[:2] == (job_id, attempt))
        self.reporters |= {(job_id, attempt, node, -1 if rank is None else rank) for node, rank in reporters}
        return before, sum(1 for r in self.reporters if r[:2] == (job_id, attempt))

    async def count_consequences(self, added: Mapping[tuple[str, int, str], int]) -> dict[tuple[str, int, str], int]:
        before = {key: self.consequences.get(key, 0) for key in added}
        self.consequences |= {key: before[key] + n for key, n in added.items()}
        return before

    async def correlate_late(
        self, job_id: str, attempt: int, ranks_by_node: dict[str, tuple[int, ...]], since: datetime
    ) -> list[StoredEvidence]:
        late = []
        for event_id, row in self.evidence.items():
            e = row.stored.evidence
            ranks = ranks_by_node.get(e.node or "")
            shared = any(s[0] == event_id for s in self.shared)
            if ranks is None or row.job_id is not None or shared or e.time is None or e.time < since:
                continue
            rank = e.rank if e.rank is not None else (ranks[0] if len(ranks) == 1 else None)
            stored = StoredEvidence(event_id, row.stored.lane, Evidence(e.data, e.time, e.node, rank, e.id))
            self.evidence[event_id] = _Row(stored, job_id, attempt)
            late.append(stored)
        return late

    async def evidence_of(self, job_id: str, attempt: int, *, ignored: Sequence[str]) -> list[Evidence]:
        return [
            r.stored.evidence
            for r in self.evidence.values()
            if (r.job_id, r.attempt) == (job_id, attempt) and r.stored.evidence.category.value not in ignored
        ]

    async def count_evidence(self, job_id: str, attempt: int, *, ignored: Sequence[str], up_to: int) -> int:
        return min(len(await self.evidence_of(job_id, attempt, ignored=ignored)), up_to + 1)

    async def load_finding(self, job_id: str, attempt: int) -> tuple[int, dict[str, Any]] | None:
        known = self.findings.get((job_id, attempt))
        return None if known is None else (known[0], known[1])

    async def save_finding(self, job_id: str, attempt: int, finding: JobFindingData) -> None:
        first = finding.first_error  # the node is kept for repeat offenders: host and network first errors only
        node = first.node if first is not None and first.lane in {Lane.HOST, Lane.NETWORK} else None
        self.findings[job_id, attempt] = (finding.version, json.loads(finding.model_dump_json()), node)

    async def other_jobs_first_error_on(self, node: str, job_id: str) -> int:
        return len({job for (job, _), (_, _, first) in self.findings.items() if first == node and job != job_id})

    async def save_started(self, job_id: str, attempt: int, rank: int, node: str | None, pid: int) -> None:
        self.pids[job_id, attempt, rank] = (node, pid)

    async def save_exit(self, job_id: str, attempt: int, ex: RankExit) -> None:
        self.exits[job_id, attempt, ex.rank] = ex

    async def exits_of(self, job_id: str, attempt: int) -> dict[int, RankExit]:
        return {rank: ex for (job, number, rank), ex in self.exits.items() if (job, number) == (job_id, attempt)}

    async def heard_per_rank(self, job_id: str, attempt: int) -> dict[int, int]:
        heard: dict[int, int] = {}
        for row in self.evidence.values():
            rank = row.stored.evidence.rank
            if (row.job_id, row.attempt) == (job_id, attempt) and rank is not None:
                heard[rank] = heard.get(rank, 0) + 1
        return heard

    async def attempt_ended(self, job_id: str, attempt: int, ended_at: datetime, window: timedelta) -> None:
        del ended_at, window
        self.windows.setdefault((job_id, attempt), False)

    async def end_window(self, job_id: str, attempt: int) -> None:
        self.windows[job_id, attempt] = True

    async def window_ended(self, job_id: str, attempt: int) -> bool:
        return self.windows.get((job_id, attempt), False)

    async def share_evidence(self, event_id: str, job_id: str, attempt: int) -> None:
        self.shared.add((event_id, job_id, attempt))
