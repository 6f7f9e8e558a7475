"""`lanes poc`: the scorecard of a drill or any time window, read from the log."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import Annotated

import typer
from nats.js import JetStreamContext

from lanes_cli.console import checked_job_id, checked_window, load_settings, out, require, run_async
from lanes_cli.drill_cli import print_report
from lanes_cli.drills import DrillReport, drill_reports
from lanes_cli.poc import CapabilityResult, Row, Verdict, scorecard
from lanes_cli.timeline import read_stream
from lanes_contract.client import connect_nats
from lanes_contract.streams import JOBS, REQUESTS
from lanes_runtime.reader import Selection

_STYLE = {Verdict.PASSED: "green", Verdict.PENDING_EVIDENCE: "yellow", Verdict.NOT_APPLICABLE: "dim"}


async def rows_of(js: JetStreamContext, selection: Selection) -> list[Row]:
    """The timeline rows of a selection, as `lanes timeline --json` prints them."""
    return [entry.as_json() for entry in await read_stream(js, selection)]


async def compute(
    nats_url: str, job: str | None, since: datetime | None, until: datetime | None
) -> tuple[list[CapabilityResult], list[DrillReport]]:
    """The scorecard of one job, or of every job in the time window, and the report of each drill in it."""
    nc = await connect_nats(nats_url, name="lanes-poc")
    try:
        js = nc.jetstream()
        subject = f"lanes.job.{job}.>" if job else "lanes.job.>"
        jobs = dataclasses.replace(Selection(JOBS.name, subject), since=since, until=until)
        requests = dataclasses.replace(Selection(REQUESTS.name, "lanes.req.>"), since=since, until=until)
        request_rows = await rows_of(js, requests)
        if job:  # one job's scorecard counts only the requests that tried it (it is a replica)
            request_rows = [row for row in request_rows if job in _replicas_tried(row)]
        rows = await rows_of(js, jobs)
        return scorecard(rows, request_rows), drill_reports(rows)
    finally:
        await nc.close()


def _replicas_tried(request: Row) -> set[str]:
    return {str(attempt.get("replica")) for attempt in (request.get("data") or {}).get("attempts", [])}


def print_scorecard(results: list[CapabilityResult]) -> None:
    """One line per capability, coloured by verdict."""
    for result in results:
        style = _STYLE[result.verdict]
        out.print(
            f"[{style}]{result.verdict.value:<17}[/{style}] {result.capability}: {result.reason}", highlight=False
        )


def poc(
    job: Annotated[str | None, typer.Option(help="Only this job's timeline.")] = None,
    since: Annotated[datetime | None, typer.Option(help="Window start (RFC 3339, UTC if no offset).")] = None,
    until: Annotated[datetime | None, typer.Option(help="Window end (RFC 3339, UTC if no offset).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The scorecard: passed, pending evidence (naming the gap) or not applicable, per capability."""
    if job is not None:
        checked_job_id(job)
    since, until = checked_window(since, until)
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    results, drills = run_async(lambda: compute(nats_url, job, since, until))
    if as_json:
        out.print_json(
            json.dumps({"capabilities": [r.as_json() for r in results], "drills": [d.as_json() for d in drills]})
        )
    else:
        print_scorecard(results)
        for report in drills:
            print_report(report)
