"""What a drill showed, read from the job's timeline rows.

How fast the platform saw, localised, decided and recovered, and whether its finding named the rank, node
and lane the fault was injected into.

Pure functions of `lanes timeline --json` rows, like `lanes poc`: the same rows always give the same report.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from lanes_cli.timeline import row_kind
from lanes_contract.events import DrillKind, Lane

Row = dict[str, Any]

EXPECTED_LANE: dict[DrillKind, Lane | None] = {
    DrillKind.KILL: Lane.HOST,  # a process killed from outside it, no kernel line: the host's side
    DrillKind.HANG: Lane.HOST,  # a stopped process on its node while its peers wait: that node's rank
    DrillKind.OOM: Lane.HOST,
    DrillKind.XID: Lane.HOST,  # the GPU's ECC error explains the CUDA failure after it
    DrillKind.EXCEPTION: Lane.ALGORITHM,
    DrillKind.SLOW: Lane.HOST,  # a straggler, not a failure: telemetry's `slowdown` must name it
    DrillKind.LINK_DOWN: Lane.NETWORK,
    DrillKind.LINK_SLOW: Lane.NETWORK,  # a degraded link, not a failure: the slowdown must name its node
}
"""The lane whose team owns each injected fault: the finding must name it."""
NODE_FAULTS = frozenset({DrillKind.LINK_DOWN, DrillKind.LINK_SLOW})
"""Faults of a node rather than of one rank: the finding must name the node; any rank on it will do."""
_EVIDENCE_KINDS = {"evidence", "rank_exited", "finding", "slowdown"}
STRAGGLERS = frozenset({DrillKind.SLOW, DrillKind.LINK_SLOW})
"""Faults that fail nothing: named by the attempt's `slowdown`, not by a settled finding; recovery only weighs a
restart (docs/recovery.md), and the drill does not wait for that decision."""
STRAGGLER_READY_STEP = 60
"""A straggler drill is injected once the job is past this step (a plan waits for a checkpoint at or after
it): telemetry reads an attempt's first 30 steps as its baseline, and a slowdown inside them is no change."""
STRAGGLER_DURATION_S = {DrillKind.SLOW: 20.0, DrillKind.LINK_SLOW: 30.0}
"""How long a plan slows a rank or a link when it names no duration: long enough for two blocks of 8 slowed
steps and the agent's word on the link (the drill tests' durations)."""


@dataclass(frozen=True)
class DrillReport:
    """One drill: what was injected where, and what the platform made of it."""

    drill_id: str
    job_id: str
    attempt: int
    kind: DrillKind
    node: str
    rank: int | None
    detect_s: float | None
    """Injection to the first evidence of the attempt (an evidence copy, a rank's exit, a finding)."""
    localise_s: float | None
    """Injection to the first settled finding naming the injected rank (its node, for a node's fault)."""
    decide_s: float | None
    """Injection to the attempt's first recovery decision."""
    recover_s: float | None
    """Injection to the next attempt running."""
    named: dict[str, Any] | None
    """The settled finding's first error: lane, category, node and rank (None: no settled finding yet)."""
    decision: str | None
    """The recovery decision's action (resume, manual, ...)."""

    @property
    def expected_lane(self) -> Lane | None:
        """The lane the finding must name (None: this kind is not a failure)."""
        return EXPECTED_LANE[self.kind]

    @property
    def wrong(self) -> str | None:
        """Why the finding does not name the injected fault, or None when it does (or nothing is to be named)."""
        if self.expected_lane is None:
            return None
        if self.named is None:
            return "no slowdown reported yet" if self.kind in STRAGGLERS else "no settled finding yet"
        misses = []
        if self.rank is not None and self.kind not in NODE_FAULTS and self.named.get("rank") != self.rank:
            misses.append(f"rank {self.named.get('rank')} instead of {self.rank}")
        if self.named.get("node") != self.node:
            misses.append(f"node {self.named.get('node')} instead of {self.node}")
        if self.named.get("lane") != self.expected_lane.value:
            misses.append(f"the {self.named.get('lane')} lane instead of {self.expected_lane.value}")
        return "; ".join(misses) or None

    @property
    def where(self) -> str:
        """`kill of rank 2 on node-3 (job j, attempt 1)`."""
        rank = f"rank {self.rank} on " if self.rank is not None else ""
        return f"{self.kind.value} of {rank}{self.node} (job {self.job_id}, attempt {self.attempt})"

    def as_json(self) -> dict[str, Any]:
        """The row of `lanes drill --json` and `lanes poc --json`."""
        return {
            "drill_id": self.drill_id,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "kind": self.kind.value,
            "node": self.node,
            "rank": self.rank,
            "detect_s": self.detect_s,
            "localise_s": self.localise_s,
            "decide_s": self.decide_s,
            "recover_s": self.recover_s,
            "named": self.named,
            "expected_lane": None if self.expected_lane is None else self.expected_lane.value,
            "named_right": self.wrong is None,
            "wrong": self.wrong,
            "decision": self.decision,
        }


def _time(row: Row) -> datetime:
    return datetime.fromisoformat(str(row["time"]))


def _after(rows: list[Row], start: datetime, matches: Any) -> float | None:
    times = [_time(row) for row in rows if row.get("time") and _time(row) >= start and matches(row)]
    return round((min(times) - start).total_seconds(), 3) if times else None


def drill_report(drill: Row, rows: list[Row]) -> DrillReport:
    """The report of one `drill_injected` row, from its job's rows (in stream order)."""
    data = drill.get("data") or {}
    attempt = int(drill.get("attempt") or 1)
    kind = DrillKind(str(data.get("kind")))
    rank = data.get("rank")
    node = str(data.get("node"))
    start = _time(drill)
    mine = [row for row in rows if row.get("attempt") == attempt]

    def evidence(row: Row) -> bool:
        return row_kind(row) in _EVIDENCE_KINDS

    def names_it(row: Row) -> bool:
        first = _named_by(row, kind)
        by_rank = rank is not None and kind not in NODE_FAULTS
        return first is not None and bool(first.get("rank") == rank if by_rank else first.get("node") == node)

    def running_again(row: Row) -> bool:
        to_state = (row.get("data") or {}).get("to_state")
        return row_kind(row) == "state_changed" and to_state == "running" and int(row.get("attempt") or 0) > attempt

    namings = [named for r in mine if (named := _named_by(r, kind)) is not None]
    first_error = namings[-1] if namings else None
    decisions = [r for r in mine if row_kind(r) == "recovery_decided" and _time(r) >= start]
    return DrillReport(
        drill_id=str(drill.get("id")),
        job_id=str(drill.get("job_id")),
        attempt=attempt,
        kind=kind,
        node=node,
        rank=rank,
        detect_s=_after(mine, start, evidence),
        localise_s=_after(mine, start, names_it),
        decide_s=_after(decisions, start, lambda _: True),
        recover_s=_after(rows, start, running_again),
        named=None
        if first_error is None
        else {key: first_error.get(key) for key in ("lane", "category", "node", "rank")},
        decision=str((decisions[0].get("data") or {}).get("action")) if decisions else None,
    )


def _named_by(row: Row, kind: DrillKind) -> dict[str, Any] | None:
    """What this row names as the fault: a settled finding's first error, or (a straggler) a slowdown's."""
    data = row.get("data") or {}
    if kind in STRAGGLERS:
        if row_kind(row) != "slowdown":
            return None
        return {
            "lane": row.get("lane"),
            "category": data.get("kind"),
            "node": data.get("node"),
            "rank": data.get("rank"),
        }
    if row_kind(row) != "finding" or not data.get("settled"):
        return None
    first: dict[str, Any] = data.get("first_error") or {}
    return first


def drill_reports(rows: list[Row]) -> list[DrillReport]:
    """A report per drill of a rank among the rows (of any set of jobs), in the order they were injected.

    A drill on an inference replica is judged from request provenance instead (`replica_drill_report`).
    """
    by_job: dict[str, list[Row]] = {}
    for row in rows:
        by_job.setdefault(str(row.get("job_id")), []).append(row)
    return [
        drill_report(row, by_job[str(row.get("job_id"))])
        for row in rows
        if row_kind(row) == "drill_injected" and (row.get("data") or {}).get("kind") not in REPLICA_DRILLS
    ]


def complete(report: DrillReport) -> bool:
    """Whether the drill has played out: settled and decided, and recovered when the decision expects it."""
    if report.expected_lane is None:
        return True
    if report.kind in STRAGGLERS:
        return report.named is not None  # nothing failed: recovery's run-on-or-restart decision is not waited for
    if report.named is None or report.decision is None:
        return False
    return report.decision == "manual" or report.recover_s is not None


REPLICA_DRILLS = frozenset({DrillKind.REPLICA_KILL, DrillKind.REPLICA_PAUSE, DrillKind.REPLICA_DRAIN})
"""Drills on an inference replica: judged by what its streams' clients saw (request provenance), not by a finding."""


@dataclass(frozen=True)
class ReplicaDrillReport:
    """One drill on an inference replica: the streams it had in flight, and what became of each."""

    drill_id: str
    replica: str
    kind: DrillKind
    node: str
    in_flight: tuple[str, ...]
    """The requests that had a try on the replica and were being answered when the drill began."""
    continued: tuple[str, ...]
    """Of those, the ones that moved to another replica after their first token and completed."""
    finished_in_place: tuple[str, ...]
    """Of those, the ones the replica itself completed (a drain lets them, a short pause may)."""
    errored: tuple[str, ...]
    """Of those, the ones whose client got an error: a lost stream."""
    moved_at: tuple[int, ...]
    """The token index at which each continued stream moved."""
    took_over: tuple[str, ...]
    """The replicas that continued the moved streams."""
    first_move_s: float | None
    """Drill to the first stream leaving the replica mid-stream."""
    routed_after: int
    """Requests received after a drain began whose first try still went to the drained replica."""

    @property
    def lost(self) -> bool:
        """Whether any stream in flight at the drill ended in an error for its client."""
        return bool(self.errored)

    @property
    def where(self) -> str:
        """`replica-kill of replica chat-a on node-1`."""
        return f"{self.kind.value} of replica {self.replica} on {self.node}"

    def as_json(self) -> dict[str, Any]:
        """The row of `lanes drill --json` for a replica."""
        return {
            "drill_id": self.drill_id,
            "replica": self.replica,
            "kind": self.kind.value,
            "node": self.node,
            "in_flight": list(self.in_flight),
            "continued": list(self.continued),
            "finished_in_place": list(self.finished_in_place),
            "errored": list(self.errored),
            "moved_at": list(self.moved_at),
            "took_over": list(self.took_over),
            "first_move_s": self.first_move_s,
            "routed_after": self.routed_after,
            "lost": self.lost,
        }


def _received(request: Row) -> datetime:
    return datetime.fromisoformat(str((request.get("data") or {}).get("received_at")))


def _ended(request: Row) -> datetime:
    return _received(request) + timedelta(milliseconds=float((request.get("data") or {}).get("latency_ms") or 0))


def replica_drill_report(drill: Row, requests: list[Row]) -> ReplicaDrillReport:
    """The report of one replica drill's `drill_injected` row, from the request rows (`lanes.req.>`)."""
    data = drill.get("data") or {}
    replica = str(drill.get("job_id"))
    start = _time(drill)

    def tried_here(request: Row) -> bool:
        return any(a.get("replica") == replica for a in (request.get("data") or {}).get("attempts") or [])

    in_flight = [r for r in requests if tried_here(r) and _received(r) <= start <= _ended(r)]
    continued, in_place, errored, moved_at, took_over, moves = [], [], [], [], [], []
    for request in in_flight:
        served = request.get("data") or {}
        rid = str(served.get("request_id"))
        attempts = served.get("attempts") or []
        if served.get("status") != "ok":
            errored.append(rid)
            continue
        mine = [i for i, a in enumerate(attempts) if a.get("replica") == replica]
        left = next((i for i in mine if attempts[i].get("outcome") == "failed_mid_stream"), None)
        if left is None or not served.get("continuations"):
            in_place.append(rid)
            continue
        continued.append(rid)
        after = attempts[left + 1] if left + 1 < len(attempts) else {}
        moved_at.append(int(after.get("first_token") or 0))
        took_over.append(str(after.get("replica")))
        elapsed = sum(float(a.get("elapsed_ms") or 0) for a in attempts[: left + 1])
        moves.append((_received(request) + timedelta(milliseconds=elapsed) - start).total_seconds())

    def first_try_here(request: Row) -> bool:
        attempts = (request.get("data") or {}).get("attempts") or []
        return bool(attempts) and attempts[0].get("replica") == replica

    draining = DrillKind(str(data.get("kind"))) is DrillKind.REPLICA_DRAIN
    ends = start + timedelta(seconds=float(data.get("duration_s") or 0)) if data.get("duration_s") else None
    routed_after = sum(
        1
        for r in requests
        if draining and first_try_here(r) and _received(r) > start and (ends is None or _received(r) < ends)
    )
    return ReplicaDrillReport(
        drill_id=str(drill.get("id")),
        replica=replica,
        kind=DrillKind(str(data.get("kind"))),
        node=str(data.get("node")),
        in_flight=tuple(str((r.get("data") or {}).get("request_id")) for r in in_flight),
        continued=tuple(continued),
        finished_in_place=tuple(in_place),
        errored=tuple(errored),
        moved_at=tuple(moved_at),
        took_over=tuple(sorted(set(took_over))),
        first_move_s=round(max(0.0, min(moves)), 3) if moves else None,
        routed_after=routed_after,
    )
