"""A job's attempts side by side (pure): where each placed its ranks, how far each rank got, what failed first.

Folded one row at a time, in stream order, from the rows the job feed sends (`rows.row_of`). Each attempt
keeps:

- its placement (rank -> node, and the topology domain holding the gang);
- its ranks: the node, the last step a heartbeat reported, how the process ended;
- its first error, elected as on the job page (`rows.FirstError`), but among that attempt's events only,
  with the cause's owner and missing evidence;
- the recovery decisions taken on it (action, reason, owner, the step the next attempt resumes from);
- the step it resumed from, so two attempts line up on the step axis, not on the clock.

The view compares the same ranks across the chosen attempts: one line per rank of any of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lanes_console.rows import FirstError

MAX_ATTEMPTS_SHOWN = 4
"""How many attempts one comparison shows side by side (the page's columns)."""
DECISION_KINDS = frozenset({"recovery_decided", "recovery_escalated", "recovery_superseded"})


@dataclass
class _Rank:
    node: str | None = None
    gpus: list[int] = field(default_factory=list)
    started: bool = False
    last_step: int | None = None
    ended: str | None = None
    failed: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpus": self.gpus,
            "started": self.started,
            "last_step": self.last_step,
            "ended": self.ended,
            "failed": self.failed,
        }


@dataclass
class _Attempt:
    number: int
    first_seen: str | None = None
    resume_step: int | None = None
    reason: str | None = None
    domain: str | None = None
    state: str | None = None
    ranks: dict[int, _Rank] = field(default_factory=dict)
    election: FirstError = field(default_factory=FirstError)
    decisions: list[dict[str, Any]] = field(default_factory=list)

    def rank(self, rank: int) -> _Rank:
        return self.ranks.setdefault(rank, _Rank())

    def as_json(self) -> dict[str, Any]:
        return {
            "attempt": self.number,
            "first_seen": self.first_seen,
            "reason": self.reason,
            "resume_step": self.resume_step,
            "domain": self.domain,
            "state": self.state,
            "placement": {str(rank): r.node for rank, r in sorted(self.ranks.items()) if r.node},
            "first_error": self.election.current,
            "decisions": self.decisions,
        }


def _step(data: Mapping[str, Any]) -> int | None:
    step = data.get("step")
    return step if isinstance(step, int) else None


class Attempts:
    """Every attempt of one job, updated one row at a time."""

    def __init__(self) -> None:
        self._attempts: dict[int, _Attempt] = {}

    def _of(self, row: Mapping[str, Any]) -> _Attempt | None:
        number = row.get("attempt")
        if not isinstance(number, int) or number < 1:
            return None  # an undecodable event, or one about the job as a whole
        if number not in self._attempts:
            self._attempts[number] = _Attempt(number, first_seen=row.get("time"))
        return self._attempts[number]

    def add(self, row: Mapping[str, Any]) -> bool:
        """Fold one row in; whether the comparison changed (a heartbeat that moves no rank's step does not)."""
        attempt = self._of(row)
        if attempt is None:
            return False
        kind = row.get("kind")
        data: Mapping[str, Any] = row.get("data") or {}
        changed = attempt.election.add(row)
        rank = row.get("rank")
        if kind == "attempt_requested":
            attempt.reason, attempt.resume_step = data.get("reason"), data.get("resume_step")
        elif kind == "placed":
            attempt.domain = data.get("domain")
            for assignment in data.get("assignments") or []:
                placed = attempt.rank(int(assignment["rank"]))
                placed.node, placed.gpus = assignment.get("node"), list(assignment.get("gpus") or [])
        elif kind == "rank_started" and isinstance(rank, int):
            started = attempt.rank(rank)
            started.started, started.node = True, started.node or row.get("node")
        elif kind == "heartbeat" and isinstance(rank, int) and (step := _step(data)) is not None:
            beating = attempt.rank(rank)
            if beating.last_step is not None and beating.last_step >= step:
                return changed
            beating.last_step, beating.started = step, True  # a rank that beats runs, its start seen or not
        elif kind == "rank_exited" and isinstance(rank, int):
            ended = attempt.rank(rank)
            ended.ended, ended.failed = str(row.get("summary") or ""), bool(row.get("failure"))
            ended.node = ended.node or row.get("node")
        elif kind == "state_changed" and data.get("to_state"):
            attempt.state = data["to_state"]
        elif kind in DECISION_KINDS:
            attempt.decisions.append(
                {
                    "seq": row["seq"],
                    "kind": kind,
                    "action": data.get("action"),
                    "reason": data.get("reason"),
                    "owner": data.get("owner"),
                    "resume_step": data.get("resume_step"),
                    "cordon": list(data.get("cordon") or []),
                    "requested_by": data.get("requested_by") or None,
                }
            )
        else:
            return changed
        return True

    def numbers(self) -> list[int]:
        """The attempts seen so far, in order."""
        return sorted(self._attempts)

    def view(self, chosen: Sequence[int] = ()) -> dict[str, Any]:
        """The comparison of `chosen` attempts (default: the last two), ranks aligned, steps on one axis."""
        numbers = [n for n in chosen if n in self._attempts] or self.numbers()[-2:]
        shown = [self._attempts[n] for n in numbers[:MAX_ATTEMPTS_SHOWN]]
        ranks = sorted({rank for attempt in shown for rank in attempt.ranks})
        steps = [
            step
            for attempt in shown
            for step in [attempt.resume_step, *(r.last_step for r in attempt.ranks.values())]
            if step is not None
        ]
        return {
            "attempts": self.numbers(),
            "shown": [attempt.as_json() for attempt in shown],
            "ranks": [
                {
                    "rank": rank,
                    "by_attempt": [
                        attempt.ranks[rank].as_json() if rank in attempt.ranks else None for attempt in shown
                    ],
                }
                for rank in ranks
            ],
            "steps": {"low": min(steps, default=0), "high": max(steps, default=0)},
        }


def chosen_attempts(values: Sequence[str]) -> list[int]:
    """The `attempt=<n>` values of a query string, or ValueError saying what is wrong."""
    numbers = []
    for value in values:
        if not value.isdigit() or not 1 <= int(value) <= 1_000_000:  # noqa: PLR2004 - far past any retry budget
            raise ValueError(f"attempt must be a whole number from 1, not {value[:20]!r}")
        numbers.append(int(value))
    if len(numbers) > MAX_ATTEMPTS_SHOWN:
        raise ValueError(f"at most {MAX_ATTEMPTS_SHOWN} attempts side by side")
    return numbers
