"""The fault bundle a team hands to the next one: `lanes incident <job>`, and the console's job page download.

Built from the job's timeline rows alone (the JSON of `lanes timeline --json`): what failed and when,
the first error and its lane, the evidence each lane contributed, the evidence still missing and whom to
ask, the recovery decision chain, the attempts affected, the time to detect, localize, decide and recover,
and for a serving job (a replica) the inference requests the fault touched and what happened to each.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from lanes_console.rows import ended_in_failure, row_kind
from lanes_console.timeline_page import LANE_ORDER, first_error, render_page
from lanes_console.verdicts import decision_verdicts

Row = dict[str, Any]


def _at(row: Row | None) -> datetime | None:
    return None if row is None else datetime.fromisoformat(str(row["time"]))


def _first(rows: Iterable[Row], predicate: Any) -> Row | None:
    return next((row for row in rows if predicate(row)), None)


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else round((end - start).total_seconds(), 6)


DECISION_KINDS = frozenset(
    {
        "recovery_decided",
        "recovery_escalated",
        "recovery_superseded",
        "manual_action",
        "hold_requested",
        "retry_requested",
        "resume_requested",
        "cancel_requested",
        "attempt_requested",
    }
)
"""Timeline rows that make up the decision chain: what was decided, by whom, and the commands it issued."""


def decision_chain(rows: Iterable[Row]) -> list[Row]:
    """The decisions and commands about the job, in order, with the fields a reader needs from each."""
    chain = []
    for row in rows:
        kind = row_kind(row)
        data = row.get("data") or {}
        if kind not in DECISION_KINDS and not (kind == "replica_state" and data.get("signal") == "recovery"):
            continue
        keep = (
            "action",
            "reason",
            "owner",
            "owner_lane",
            "policy",
            "policy_version",
            "expects",
            "requested_by",
            "cordon",
            "lost_work",
            "deadline",
            "finding_version",
            "settled",
            "replanned",
            "uncordon",
        )
        step = {"id": row["id"], "time": row["time"], "kind": kind, "attempt": row.get("attempt")}
        step |= {key: data[key] for key in keep if data.get(key) not in (None, "", [])}
        if data.get("checkpoint"):
            step["resume_step"] = data["checkpoint"]["step"]
        chain.append(step)
    return chain


def affected_requests(requests: Iterable[Row], replica: str, nodes: Iterable[str] = ()) -> dict[str, Any]:
    """The requests that tried `replica` (or ran on a faulty node), and what became of each.

    `requests` are `RequestServed` rows; a request that failed over is served by another replica, so it is
    found by its attempts, not by its subject.
    """
    faulty = set(nodes)
    touched = [
        row
        for row in requests
        if any(
            a.get("replica") == replica or a.get("node") in faulty for a in (row.get("data") or {}).get("attempts", [])
        )
    ]
    outcomes: dict[str, int] = {}
    listed = []
    for row in touched:
        data = row["data"]
        attempts = data.get("attempts", [])
        moved = len(attempts) > 1 and data["status"] == "ok"
        outcome = "failed_over" if moved else ("ok" if data["status"] == "ok" else data["status"])
        if any(a.get("outcome") == "failed_mid_stream" for a in attempts):
            # A stream continued on another replica lost nothing; one that was not continued ended in error.
            outcome = "continued" if data.get("continuations") and data["status"] == "ok" else "failed_mid_stream"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        listed.append(
            {
                "request_id": data["request_id"],
                "time": row["time"],
                "outcome": outcome,
                "served_by": data["replica"],
                "http_status": data["http_status"],
                "attempts": [f"{a['replica']}:{a['outcome']}" for a in attempts],
                "moved_at_tokens": [a["first_token"] for a in attempts[1:] if a.get("first_token")],
            }
        )
    return {"count": len(listed), "outcomes": dict(sorted(outcomes.items())), "requests": listed}


def bundle(job: dict[str, Any], requests: Iterable[Row] = ()) -> dict[str, Any]:
    """The incident summary of one job (`job` as `lanes job --json` plus its `timeline` rows).

    `requests` are the `RequestServed` rows of the job's time window, for a serving job.
    """
    rows: list[Row] = list(job.get("timeline", []))
    found = first_error(job)
    # Stream sequences differ from server to server; the event id names the first error everywhere.
    error = None if found is None else {key: value for key, value in found.items() if key != "seq"}
    detected = _first(rows, ended_in_failure)
    localized = _first(rows, lambda r: row_kind(r) == "finding")  # the first version: time to localize
    decided = _first(rows, lambda r: "recovery" in str(r.get("type")))
    after = [r for r in rows if detected is not None and r["seq"] > detected["seq"]]
    recovered = _first(
        after,
        lambda r: row_kind(r) == "state_changed" and (r.get("data") or {}).get("to_state") in {"running", "released"},
    )
    missing = (error or {}).get("missing_evidence") or {}
    fault_nodes = [node for node in [(error or {}).get("node")] if node]
    summary: dict[str, Any] = {
        "job_id": job.get("job_id"),
        "state": job.get("state"),
        "summary": {
            "failed": detected is not None,
            "first_error": error,
            "lane": (error or {}).get("lane"),
            "owner": (error or {}).get("owner"),
            "detected_at": None if detected is None else detected["time"],
        },
        # Events are named by id, not stream sequence, so the bundle reads the same on any server it is replayed to.
        "evidence": {lane: [r["id"] for r in rows if r.get("lane") == lane] for lane in LANE_ORDER},
        "missing_evidence": missing,
        "recovery": [
            {"id": r["id"], "type": r["type"], "data": r.get("data")} for r in rows if "recovery" in str(r["type"])
        ],
        "decision_chain": decision_chain(rows),
        # Which finding each decision used, and what the attempt's final finding says.
        "decisions": [verdict.as_json() for verdict in decision_verdicts(rows)],
        "attempts": sorted({int(r["attempt"]) for r in rows if r.get("attempt")}),
        "durations_s": {
            "to_detect": _seconds(_at(rows[0]) if rows else None, _at(detected)),
            "to_localize": _seconds(_at(detected), _at(localized)),
            "to_decide": _seconds(_at(detected), _at(decided)),
            "to_recover": _seconds(_at(detected), _at(recovered)),
        },
    }
    requests = list(requests)
    if requests:
        summary["requests"] = affected_requests(requests, str(job.get("job_id")), fault_nodes)
    return summary


def serves(rows: Iterable[Row]) -> bool:
    """Whether the job is an inference replica (its submitted spec names what it serves)."""
    return any(
        ((row.get("data") or {}).get("spec") or {}).get("serving") for row in rows if row_kind(row) == "submitted"
    )


BUNDLE_FILES = ("incident.json", "timeline.html", "events.ndjson")


def bundle_files(job: dict[str, Any], ndjson_lines: Iterable[bytes], requests: Iterable[Row] = ()) -> dict[str, bytes]:
    """The bundle's files by name: incident.json, timeline.html and events.ndjson (replayable elsewhere)."""
    requests = list(requests)
    return {
        "incident.json": (json.dumps(bundle(job, requests), indent=2) + "\n").encode(),
        "timeline.html": render_page(job).encode(),
        "events.ndjson": b"".join(line + b"\n" for line in ndjson_lines),
    }


def write_bundle(
    job: dict[str, Any], ndjson_lines: Iterable[bytes], directory: Path, requests: Iterable[Row] = ()
) -> list[Path]:
    """Write incident.json, timeline.html and events.ndjson (replayable elsewhere) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in bundle_files(job, ndjson_lines, requests).items():
        (directory / name).write_bytes(content)
        written.append(directory / name)
    return written
