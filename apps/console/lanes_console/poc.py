"""The POC page's verdict table (pure), from the report `lanes poc run --out DIR` writes (DIR/poc.json).

One line per capability, one column per rung (and inference): each cell says its verdict and what evidence
is missing, and links to where the evidence is, the rung's job on this console: its attempts side by side
for recovery and goodput (the attempts a drill made), its timeline for the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_REPORT_BYTES = 16 * 2**20
"""A poc.json larger than this is refused: a report of any plan is far smaller."""
_BY_ATTEMPTS = frozenset({"recovery", "goodput"})


class ReportError(ValueError):
    """The report cannot be read or is not a `lanes poc run` report; the message says which."""


def read_report(path: Path) -> dict[str, Any]:
    """The JSON of a `lanes poc run` report, or ReportError."""
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:
            msg = f"{path} is over {MAX_REPORT_BYTES // 2**20} MiB: not a POC report"
            raise ReportError(msg)
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        msg = f"cannot read the POC report {path}: {exc}"
        raise ReportError(msg) from exc
    if not isinstance(report, dict) or not {"rungs", "verdicts"} <= report.keys():
        msg = f"{path} is not a `lanes poc run` report (poc.json): no rungs and verdicts"
        raise ReportError(msg)
    return report


def verdict_table(report: dict[str, Any]) -> dict[str, Any]:
    """Columns (rungs, then inference) and one line per capability, each cell with its verdict and evidence link."""
    rungs = {str(rung.get("label")): rung for rung in report.get("rungs") or [] if isinstance(rung, dict)}
    columns = list(rungs)
    capabilities: list[str] = []
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    for cell in report.get("verdicts") or []:
        capability, rung = str(cell.get("capability")), str(cell.get("rung"))
        if capability not in capabilities:
            capabilities.append(capability)
        if rung not in columns:
            columns.append(rung)
        cells[capability, rung] = cell
    lines = []
    for capability in capabilities:
        line = []
        for column in columns:
            cell = cells.get((capability, column))
            job = (rungs.get(column) or {}).get("job_id")
            href = None
            if cell is not None and isinstance(job, str) and job:
                href = f"/jobs/{job}/attempts" if capability in _BY_ATTEMPTS else f"/jobs/{job}"
            line.append(
                None
                if cell is None
                else {"verdict": str(cell.get("verdict")), "missing": str(cell.get("missing") or ""), "href": href}
            )
        lines.append({"capability": capability, "cells": line})
    return {
        "columns": columns,
        "jobs": {label: rung.get("job_id") for label, rung in rungs.items()},
        "lines": lines,
        "report": report.get("report"),
    }
