"""`lanes poc`: the scorecard of a drill or any time window, read from the log; `lanes poc run` runs a POC plan."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from nats.js import JetStreamContext

from lanes_agent.faults import kernel_faults_unavailable
from lanes_cli.agent_cli import node_networks
from lanes_cli.console import (
    EXIT_BAD_INPUT,
    checked_job_id,
    checked_window,
    err,
    fail,
    load_settings,
    out,
    print_big_json,
    require,
    run_async,
)
from lanes_cli.demo import FaultPaths
from lanes_cli.drill_cli import print_report
from lanes_cli.drills import DrillReport, drill_reports
from lanes_cli.input_files import read_text_file
from lanes_cli.poc import CapabilityResult, Row, Verdict, scorecard
from lanes_cli.poc_plan import PlanError, default_plan_text, parse_plan
from lanes_cli.poc_report import print_table, render_report
from lanes_cli.poc_run import cluster_nodes, run_plan
from lanes_cli.stack import servers
from lanes_cli.timeline import read_stream
from lanes_contract.client import connect_nats
from lanes_contract.streams import JOBS, REQUESTS
from lanes_runtime.reader import Selection

_STYLE = {Verdict.PASSED: "green", Verdict.PENDING_EVIDENCE: "yellow", Verdict.NOT_APPLICABLE: "dim"}
app = typer.Typer(invoke_without_command=True, help="The POC scorecard of the log, or (`lanes poc run`) a POC run.")


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


@app.callback()
def poc(
    ctx: typer.Context,
    job: Annotated[str | None, typer.Option(help="Only this job's timeline.")] = None,
    since: Annotated[datetime | None, typer.Option(help="Window start (RFC 3339, UTC if no offset).")] = None,
    until: Annotated[datetime | None, typer.Option(help="Window end (RFC 3339, UTC if no offset).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The scorecard: passed, pending evidence (naming the gap) or not applicable, per capability."""
    if ctx.invoked_subcommand is not None:
        return
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


@app.command("run")
def run(
    plan: Annotated[
        Path | None, typer.Argument(help="The POC plan (YAML); without one, the shipped default plan.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run's JSON instead of the table.")] = False,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="Write events.ndjson (a bundle `lanes import` reads), poc.json and report.html."),
    ] = None,
    netns: Annotated[
        bool, typer.Option("--netns", help="Each node's ranks in a network namespace of its own (root).")
    ] = False,
    kernel: Annotated[bool, typer.Option("--kernel", help="Faults through this host's kernel (root).")] = False,
) -> None:
    """Run a POC plan end to end: every rung, a drill at each, one verdict table read from the timeline."""
    text = default_plan_text() if plan is None else read_text_file(plan, what="a POC plan is YAML")
    try:
        parsed = parse_plan(text)
    except PlanError as exc:
        fail(f"{plan or 'the default plan'}: {exc}", EXIT_BAD_INPUT)
    if out_dir is not None:
        if out_dir.exists() and not out_dir.is_dir():
            fail(f"--out {out_dir} is not a directory", EXIT_BAD_INPUT)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(f"--out {out_dir}: {exc.strerror}", EXIT_BAD_INPUT)
    settings = load_settings(quiet=True)
    unavailable = kernel_faults_unavailable() if kernel else None
    if unavailable:
        err.print(f"--kernel: {unavailable}; the faults are played")
    networks = node_networks(cluster_nodes(parsed)) if netns else None
    paths = FaultPaths(networks, through_kernel=kernel and unavailable is None)
    bundle = None if out_dir is None else out_dir / "events.ndjson"
    try:
        with tempfile.TemporaryDirectory(prefix="lanes-poc-") as work, servers(settings) as urls:
            result = run_async(
                lambda: run_plan(urls, parsed, Path(work), paths=paths, bundle=bundle, progress=_progress)
            )
    except KeyboardInterrupt:
        fail("interrupted; embedded servers stopped", 130)
    finally:
        if networks is not None:
            networks.down()
    report = None
    if out_dir is not None:
        page = out_dir / "report.html"
        page.write_text(render_report(result.as_json(str(page))), encoding="utf-8")
        report = str(page)
        (out_dir / "poc.json").write_text(json.dumps(result.as_json(report), indent=2), encoding="utf-8")
    if as_json:
        print_big_json(result.as_json(report))
    else:
        print_table(out, result.as_json(report))


def _progress(line: str) -> None:
    err.print(line, highlight=False)
