"""`lanes incident <job>`: the fault bundle a team hands to the next one.

Built from the job's timeline rows alone (the JSON of `lanes timeline --json`): what failed and when,
the first error and its lane, the evidence each lane contributed, the evidence still missing and whom to
ask, the recovery decisions, the attempts affected, and the time to detect, localize, decide and recover.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from lanes_ops.html import LANE_ORDER, first_error, render_page
from lanes_ops.timeline import is_failure, row_kind

Row = dict[str, Any]


def _at(row: Row | None) -> datetime | None:
    return None if row is None else datetime.fromisoformat(str(row["time"]))


def _first(rows: Iterable[Row], predicate: Any) -> Row | None:
    return next((row for row in rows if predicate(row)), None)


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else round((end - start).total_seconds(), 6)


def bundle(job: dict[str, Any]) -> dict[str, Any]:
    """The incident summary of one job (`job` as `lanes job --json` plus its `timeline` rows)."""
    rows: list[Row] = list(job.get("timeline", []))
    found = first_error(job)
    # Stream sequences differ from server to server; the event id names the first error everywhere.
    error = None if found is None else {key: value for key, value in found.items() if key != "seq"}
    detected = _first(rows, is_failure)
    localized = _first(rows, lambda r: row_kind(r) == "finding")  # the first version: time to localize
    decided = _first(rows, lambda r: "recovery" in str(r.get("type")))
    after = [r for r in rows if detected is not None and r["seq"] > detected["seq"]]
    recovered = _first(
        after,
        lambda r: row_kind(r) == "state_changed" and (r.get("data") or {}).get("to_state") in {"running", "released"},
    )
    missing = (error or {}).get("missing_evidence") or {}
    return {
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
        "attempts": sorted({int(r["attempt"]) for r in rows if r.get("attempt")}),
        "durations_s": {
            "to_detect": _seconds(_at(rows[0]) if rows else None, _at(detected)),
            "to_localize": _seconds(_at(detected), _at(localized)),
            "to_decide": _seconds(_at(detected), _at(decided)),
            "to_recover": _seconds(_at(detected), _at(recovered)),
        },
    }


def write_bundle(job: dict[str, Any], ndjson_lines: Iterable[bytes], directory: Path) -> list[Path]:
    """Write incident.json, timeline.html and events.ndjson (replayable elsewhere) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    summary, page, events = directory / "incident.json", directory / "timeline.html", directory / "events.ndjson"
    summary.write_text(json.dumps(bundle(job), indent=2) + "\n")
    page.write_text(render_page(job))
    with events.open("wb") as out:
        for line in ndjson_lines:
            out.write(line + b"\n")
    return [summary, page, events]
