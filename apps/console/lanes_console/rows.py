"""What the console shows of one stored event, which events a view keeps, and the job's first error (pure).

A row is the JSON the page draws: the join keys of the event (seq, time, lane, attempt, node, rank, source,
type), its data, and one line saying what it means. The first error is elected the way `lanes timeline
--html` does: the latest version of telemetry's finding when there is one, else the first rank that did not
exit cleanly. The election always sees every event of the job, whatever the view filters out, so a filter
never changes which event is the first error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lanes_contract.codec import decode, format_time
from lanes_contract.errors import DecodeError
from lanes_contract.events import Lane

LANES = tuple(lane.value for lane in Lane)
"""The swimlanes, top to bottom."""
MAX_QUERY_CHARS = 2048
"""A query string longer than this is refused (414): every view's state fits in far less."""
MAX_PATTERN_CHARS = 200
"""The longest text filter (a regular expression) a view accepts."""
MAX_SEARCHED_CHARS = 4096
"""How much of an event a text filter reads: its keys, its summary and the start of its data."""
MAX_SUMMARY_CHARS = 300
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class BadQueryError(ValueError):
    """A view's query string asks for something the console cannot do; the message says what (HTTP 400)."""


def row_of(seq: int, subject: str, headers: Mapping[str, str] | None, payload: bytes) -> dict[str, Any]:
    """The row of one stored message; an undecodable one keeps its place with the reason."""
    try:
        event = decode(subject, headers, payload)
    except DecodeError as exc:
        said = summary_of("", {"error": str(exc)})
        return {
            "seq": seq,
            "subject": subject,
            "type": None,
            "lane": None,
            "error": str(exc),
            "summary": said,
            "failure": True,
        }
    data = event.model_dump(mode="json")["data"]
    row = {
        "seq": seq,
        "id": event.id,
        "time": format_time(event.time),
        "type": event.type,
        "kind": kind_of(event.type),
        "lane": event.lane.value,
        "job_id": event.jobid,
        "attempt": event.attempt,
        "node": event.node,
        "rank": event.rank,
        "source": event.source,
        "data": data,
    }
    row["summary"] = summary_of(row["kind"], data)
    row["failure"] = is_failure(row)
    return row


def kind_of(event_type: str | None) -> str:
    """The event's name within its family: `placed` for `io.lanes.job.placed.v1`."""
    parts = str(event_type or "").split(".")
    return parts[-2] if len(parts) >= 2 else ""  # noqa: PLR2004 - <name>.v<N> ends every type


FAILING_KINDS = frozenset({"rank_exited", "state_changed", "evidence", "finding", "rejected", "escalated"})
"""The only kinds `is_failure` or `FirstError` read anything in: an event of another kind is never a failure."""


def subject_kind(subject: str) -> str:
    """The kind a subject names, its last token: `rank_exited` in `lanes.job.<job>.rank_exited`."""
    return subject.rsplit(".", 1)[-1]


def row_kind(row: Mapping[str, Any]) -> str:
    """The event name of a row (the console's or `lanes timeline --json`'s): `placed` for `io.lanes.job.placed.v1`."""
    return kind_of(row.get("type"))


def ended_in_failure(row: Mapping[str, Any]) -> bool:
    """A rank that did not exit 0, or a job moved to a failed state: what an incident counts as detected.

    Narrower than `is_failure`, which also shows evidence and findings as failures on the page.
    """
    data = row.get("data") or {}
    if row_kind(row) == "rank_exited":
        return data.get("exit_code") not in (0, None) or bool(data.get("signal"))
    return row_kind(row) == "state_changed" and data.get("to_state") in {"failed", "partially_failed"}


def is_failure(row: Mapping[str, Any]) -> bool:
    """A rank that did not exit cleanly, a job or attempt moved to a failed state, evidence or a finding."""
    data = row.get("data") or {}
    kind = row.get("kind")
    if kind == "rank_exited":
        return data.get("exit_code") not in (0, None) or bool(data.get("signal"))
    if kind == "state_changed":
        return data.get("to_state") in {"failed", "partially_failed"} or data.get("state") == "unhealthy"
    return kind in _FAILURE_KINDS or row.get("type") is None


_FAILURE_KINDS = frozenset({"evidence", "finding", "rejected", "transition_rejected", "recovery_escalated"})
"""Events that are failures whatever they carry: evidence, a finding, a refusal, an unanswered manual wait."""


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def summary_of(kind: str, data: Mapping[str, Any]) -> str:
    """One line saying what an event means, from its data (the page shows it as text, never as markup)."""
    said: str
    if kind == "state_changed" and "state" in data:  # a node's
        said = f"{_text(data.get('state'))} ({_text(data.get('reason'))})"
    elif kind == "state_changed":
        said = f"{_text(data.get('from_state')) or '-'} -> {_text(data.get('to_state'))} ({_text(data.get('reason'))})"
    elif kind == "rank_exited":
        said = f"signal {data['signal']}" if data.get("signal") else f"exit {_text(data.get('exit_code'))}"
    elif kind == "evidence":
        evidence = data.get("evidence") or {}
        lines = evidence.get("lines") or [""]
        said = f"{_text(evidence.get('category'))}: {_text(evidence.get('summary') or lines[0])}"
    elif "category" in data and "lines" in data:  # what an agent reported of its node, before any job has it
        said = f"{_text(data.get('category'))}: {_text(data.get('summary') or next(iter(data['lines']), ''))}"
    elif kind == "finding":
        cause = data.get("first_error") or {}
        owner = f" (owner {data['owner']})" if data.get("owner") else ""
        said = f"first error: {_text(cause.get('category'))}: {_text(cause.get('summary'))}{owner}"
    elif kind == "waiting":
        said = f"{_text(data.get('reason'))}: {_text(data.get('detail'))}"
    elif kind == "submitted":
        spec = data.get("spec") or {}
        said = f"{_text(spec.get('name'))}: {_text(spec.get('workers'))} workers"
    elif kind == "placed":
        said = " ".join(f"r{a.get('rank')}@{a.get('node')}" for a in data.get("assignments") or [])
    else:
        said = " ".join(f"{key}={value}" for key, value in data.items() if isinstance(value, str | int | float))
    # One line without control characters, whatever the event says: a terminal escape or a carriage return
    # copied out of the page into a log or a terminal does nothing there (the event's data keeps them as sent).
    return " ".join(_CONTROL.sub(" ", said).split())[:MAX_SUMMARY_CHARS]


class FirstError:
    """The job's elected first error, updated one row at a time in stream order."""

    def __init__(self) -> None:
        self._finding: tuple[int, int] | None = None
        """(version, seq) of the finding in force."""
        self._exit_seq: int | None = None
        self.current: dict[str, Any] | None = None

    def add(self, row: Mapping[str, Any]) -> bool:
        """Fold one row in; whether the elected first error changed."""
        data = row.get("data") or {}
        if row.get("kind") == "finding" and isinstance(data.get("first_error"), dict):
            key = (int(data.get("version") or 0), int(row["seq"]))
            if self._finding is not None and key <= self._finding:
                return False  # an older version of the finding arrived late: the newer one stays
            self._finding = key
            cause = data["first_error"]
            self.current = {
                "seq": row["seq"],
                "rank": cause.get("rank"),
                "node": cause.get("node"),
                "lane": cause.get("lane"),
                "category": cause.get("category"),
                "detail": cause.get("summary") or cause.get("category"),
                "owner": data.get("owner"),
                "missing_evidence": missing_by_lane(data.get("missing_evidence") or []),
            }
            return True
        if self._finding is None and self._exit_seq is None and row.get("kind") == "rank_exited" and row["failure"]:
            self._exit_seq = int(row["seq"])
            self.current = {
                "seq": row["seq"],
                "rank": row.get("rank"),
                "node": row.get("node"),
                "lane": row.get("lane"),
                "category": "process_exit",
                "detail": f"rank {row.get('rank')} ended with {row['summary']}",
                "owner": None,
                "missing_evidence": {},
            }
            return True
        return False


def missing_by_lane(missing: list[dict[str, Any]]) -> dict[str, list[str]]:
    """A finding's missing evidence grouped by lane, each item saying what and where."""
    grouped: dict[str, list[str]] = {}
    for item in missing:
        where = ", ".join(f"{key} {item[key]}" for key in ("node", "rank") if item.get(key) is not None)
        grouped.setdefault(str(item.get("lane")), []).append(f"{item.get('what')}" + (f" ({where})" if where else ""))
    return grouped


@dataclass(frozen=True)
class Filters:
    """Which rows a job view shows: failures only, some lanes, a text pattern. All of it is in the URL."""

    failures: bool = False
    lanes: tuple[str, ...] = ()
    pattern: re.Pattern[str] | None = None

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> Filters:
        """The filters of a query string (`failures=1`, `lane=host,network`, `q=<regex>`), or BadQueryError."""
        failures = query.get("failures", "")
        if failures not in {"", "0", "1"}:
            raise BadQueryError("failures must be 0 or 1")
        lanes = tuple(part for part in query.get("lane", "").split(",") if part)
        if unknown := [lane for lane in lanes if lane not in LANES]:
            raise BadQueryError(f"unknown lane {unknown[0][:40]!r}; the lanes are {', '.join(LANES)}")
        text = query.get("q", "")
        if len(text) > MAX_PATTERN_CHARS:
            raise BadQueryError(f"the text filter q is {len(text)} characters; at most {MAX_PATTERN_CHARS}")
        try:
            pattern = re.compile(text, re.IGNORECASE) if text else None
        except re.error as exc:
            raise BadQueryError(f"the text filter q is not a regular expression: {exc}") from exc
        return cls(failures == "1", lanes, pattern)

    def keeps(self, row: Mapping[str, Any]) -> bool:
        """Whether the view shows this row."""
        if self.failures and not row.get("failure"):
            return False
        if self.lanes and row.get("lane") not in self.lanes:
            return False
        return self.pattern is None or self.pattern.search(searched_text(row)) is not None


def searched_text(row: Mapping[str, Any]) -> str:
    """What a text filter reads of a row: its keys, its summary, then its data, bounded."""
    keys = " ".join(
        _text(row.get(key)) for key in ("type", "lane", "node", "rank", "attempt", "source", "summary", "error")
    )
    data = json.dumps(row.get("data"), separators=(",", ":"), ensure_ascii=False)
    return f"{keys} {data}"[:MAX_SEARCHED_CHARS]


JOBS_LIST_KINDS = ("submitted", "state_changed", "finding")
"""The events the jobs list folds: a job's name, its state, and the lane and owner of its first error."""


def job_update(row: Mapping[str, Any]) -> dict[str, Any]:
    """What one event changes in the jobs list (the page folds these by job id, later ones winning)."""
    data = row.get("data") or {}
    update: dict[str, Any] = {"seq": row["seq"], "job_id": row.get("job_id"), "time": row.get("time")}
    if row.get("kind") == "submitted":
        spec = data.get("spec") or {}
        update |= {"name": spec.get("name"), "state": "submitted", "tenant": spec.get("tenant") or "default"}
    elif row.get("kind") == "state_changed":
        update["state"] = data.get("to_state")
    elif row.get("kind") == "finding" and isinstance(data.get("first_error"), dict):
        update |= {"error_lane": data["first_error"].get("lane"), "owner": data.get("owner")}
    return update


_NUMBERS = re.compile(r"\d+")
MAX_GROUP_RANKS = 64
"""How many of a group's ranks the page lists when it is expanded (the count is always whole)."""


def consequence_key(row: Mapping[str, Any]) -> str | None:
    """Which group a failure row falls in: same kind, lane and what it says, numbers aside; None if no failure.

    A rank's exit keeps its numbers: `exit 137` and `exit 1` are different ends.

    1,024 ranks that time out in the same collective say the same thing but for their rank and timings:
    one group. A rank OOM-killed says something else: a group of its own.
    """
    if not row.get("failure") or row.get("type") is None:
        return None
    said = str(row.get("summary") or "")
    if row.get("kind") != "rank_exited":  # an exit status or signal says what happened: it stays
        said = _NUMBERS.sub("#", said)
    return f"{row.get('kind')}|{row.get('lane')}|{said}"


@dataclass
class _Group:
    key: str
    kind: str
    lane: str | None
    said: str
    first_seq: int
    last_seq: int = 0
    count: int = 0
    ranks: list[int] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)


class Consequences:
    """The job's failure rows grouped by what they say (`consequence_key`), with counts, in stream order."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._key_of: dict[int, str] = {}
        """seq -> key of each failure row: which group holds the first error, whenever it is elected."""

    def add(self, row: Mapping[str, Any]) -> str | None:
        """Fold one row in; its group's key (None for a row that is no failure)."""
        key = consequence_key(row)
        if key is None:
            return None
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(
                key, str(row.get("kind")), row.get("lane"), str(row.get("summary") or ""), int(row["seq"])
            )
        group.count += 1
        group.last_seq = int(row["seq"])
        if isinstance(row.get("rank"), int) and len(group.ranks) < MAX_GROUP_RANKS:
            group.ranks.append(row["rank"])
        if row.get("node"):
            group.nodes.add(str(row["node"]))
        self._key_of[int(row["seq"])] = key
        return key

    def view(self, first_error: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        """The groups of more than one row, largest first, each saying whether it is the first error's consequence."""
        first_key = None if first_error is None else self._key_of.get(int(first_error["seq"]))
        shown = sorted((g for g in self._groups.values() if g.count > 1), key=lambda g: (-g.count, g.first_seq))
        return [
            {
                "key": group.key,
                "kind": group.kind,
                "lane": group.lane,
                "says": group.said,
                "count": group.count,
                "ranks": group.ranks,
                "nodes": len(group.nodes),
                "first_seq": group.first_seq,
                "last_seq": group.last_seq,
                "holds_first_error": group.key == first_key,
                # The election names one first error; every other failure it did not pick is what that fault caused.
                "consequence": first_error is not None and group.key != first_key and group.kind != "finding",
            }
            for group in shown
        ]
