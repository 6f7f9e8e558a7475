"""`lanes drill`: inject a real fault into a running job's rank, and judge what the platform made of it.

The drill finds the rank's process from the job's timeline (its `rank_started` of the running attempt), puts
a `drill_injected` event on the timeline (platform lane: what, where, when, by whom), injects the fault
(`lanes_agent.faults`) and waits until the drill has played out: a settled finding, a recovery decision and,
when the decision resumes, the next attempt running. It prints the times and whether the finding named the
injected rank, node and lane. `--plan` runs a sequence and prints the scorecard.

It runs on the rank's host: the simulated nodes of `lanes up` share one.
"""

from __future__ import annotations

import asyncio
import getpass
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from nats.js import JetStreamContext
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lanes_agent.faults import KMSG, FaultError, inject
from lanes_agent.ledger import process_start
from lanes_cli.console import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    checked_job_id,
    fail,
    load_settings,
    out,
    require,
    run_async,
)
from lanes_cli.drills import DrillReport, complete, drill_report
from lanes_cli.input_files import load_yaml, validation_problems
from lanes_cli.limits import MAX_OPTION_SECONDS, MAX_RANKS
from lanes_cli.timeline import job_timeline, row_kind
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.events import DrillInjected, DrillInjectedData, DrillKind
from lanes_contract.jobs import Token

Row = dict[str, Any]
_POLL_S = 0.5


class DrillStep(BaseModel):
    """One drill of a plan."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    job: Token
    kind: DrillKind
    rank: int = Field(ge=0)
    duration_s: float | None = Field(default=None, gt=0)


class DrillPlan(BaseModel):
    """`drills.yaml`: the drills to run, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    drills: list[DrillStep] = Field(min_length=1)


def register(app: typer.Typer) -> None:
    """Add `lanes drill` to the CLI."""
    app.command()(drill)


async def _rows(js: JetStreamContext, job_id: str) -> list[Row]:
    return [entry.as_json() for entry in await job_timeline(js, job_id)]


class UnknownJobError(FaultError):
    """The job to drill has no events at all: a typo, not a job in the wrong state."""


def running_rank(rows: list[Row], rank: int) -> tuple[int, str, int]:
    """The (attempt, node, pid) of `rank` in the job's running attempt, or a FaultError saying why not."""
    states = [row for row in rows if row_kind(row) == "state_changed"]
    if not states or (states[-1].get("data") or {}).get("to_state") != "running":
        now = (states[-1].get("data") or {}).get("to_state") if states else "unknown"
        msg = f"the job is not running (it is {now}): a drill needs a running attempt"
        raise FaultError(msg)
    attempt = int(states[-1].get("attempt") or 1)
    for row in rows:
        if row_kind(row) == "rank_started" and row.get("attempt") == attempt and row.get("rank") == rank:
            pid = (row.get("data") or {}).get("pid")
            if pid is None:
                msg = f"rank {rank} of attempt {attempt} has no known process (observed jobs cannot be drilled)"
                raise FaultError(msg)
            return attempt, str(row.get("node")), int(pid)
    msg = f"the running attempt {attempt} has no rank {rank}"
    raise FaultError(msg)


async def run_drill(
    client: LanesClient, step: DrillStep, *, timeout_s: float, kmsg: Path = KMSG, by: str = ""
) -> DrillReport:
    """Inject one drill, then wait (at most `timeout_s`) for it to play out; its report either way."""
    js = client.js
    rows = await _rows(js, step.job)
    if not rows:
        msg = f"unknown job {step.job!r}: no events on lanes.job.{step.job}.>"
        raise UnknownJobError(msg)
    attempt, node, pid = running_rank(rows, step.rank)
    if process_start(pid) is None:  # checked before the drill is announced: no drill event for a fault never made
        msg = f"rank {step.rank}'s process {pid} is not running on this host (run the drill on the rank's node)"
        raise FaultError(msg)
    announced = DrillInjectedData(
        kind=step.kind, node=node, rank=step.rank, pid=pid, duration_s=step.duration_s, requested_by=by
    )
    event = DrillInjected(
        source="lanes/cli", jobid=step.job, attempt=attempt, node=node, rank=step.rank, data=announced
    )
    await client.publish(event)  # before the fault: its time is the start of every measure
    injecting = asyncio.create_task(inject(step.kind, pid, node=node, duration_s=step.duration_s, kmsg=kmsg))
    async with asyncio.timeout(timeout_s):
        while True:
            if injecting.done():
                injecting.result()  # a fault that could not be injected is said now, not hidden behind a timeout
            rows = await _rows(js, step.job)
            drilled = next(row for row in rows if row.get("id") == event.id)
            report = drill_report(drilled, rows)
            if complete(report) and injecting.done():
                break
            await asyncio.sleep(_POLL_S)
    await injecting
    return report


def print_report(report: DrillReport) -> None:
    """One line per drill: the times, and whether the finding named the fault."""
    times = "  ".join(
        f"{name} {'-' if value is None else f'{value:.1f} s'}"
        for name, value in (
            ("detect", report.detect_s),
            ("localise", report.localise_s),
            ("decide", report.decide_s),
            ("recover", report.recover_s),
        )
    )
    named = report.named or {}
    found = f"{named.get('lane')}/{named.get('category')} rank {named.get('rank')} on {named.get('node')}"
    verdict = "[green]named right[/green]" if report.wrong is None else f"[red]named wrongly: {report.wrong}[/red]"
    out.print(f"{report.where}: {times}; finding {found}; {verdict}; decision {report.decision}", highlight=False)


def drill(  # noqa: PLR0917 - typer maps each option to a parameter
    job: Annotated[str | None, typer.Argument(help="The running job to drill (or give --plan).")] = None,
    kind: Annotated[DrillKind | None, typer.Option(help="What to inject.")] = None,
    rank: Annotated[int, typer.Option(help="Into which rank of the running attempt.", min=0, max=MAX_RANKS - 1)] = 0,
    duration: Annotated[
        float | None, typer.Option(help="Seconds a hang, slow or link-slow lasts.", min=0.1, max=MAX_OPTION_SECONDS)
    ] = None,
    plan: Annotated[Path | None, typer.Option(help="A YAML file of drills (job, kind, rank, duration_s).")] = None,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for each drill to play out.", min=1, max=MAX_OPTION_SECONDS)
    ] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Inject a real fault (kill, hang, slow, oom, xid, exception, link-down, link-slow); judge the answer."""
    settings = load_settings(quiet=True)
    url = require(settings.nats_url, "NATS_URL")
    if plan is not None:
        try:
            steps = DrillPlan.model_validate(load_yaml(plan)).drills
        except ValidationError as exc:
            fail(f"drill plan {plan}: {validation_problems(exc, 'plan')}", EXIT_BAD_INPUT)
    elif job is not None and kind is not None:
        steps = [DrillStep(job=checked_job_id(job), kind=kind, rank=rank, duration_s=duration)]
    else:
        fail("give a job and --kind, or --plan", EXIT_BAD_INPUT)

    async def run_all() -> list[DrillReport]:
        nc = await connect_nats(url, name="lanes-drill")
        try:
            client = LanesClient(nc, "lanes/cli")
            return [await run_drill(client, step, timeout_s=timeout, by=getpass.getuser()) for step in steps]
        finally:
            await nc.close()

    try:
        reports = run_async(run_all)
    except UnknownJobError as exc:
        fail(str(exc), EXIT_NOT_FOUND)
    except FaultError as exc:
        fail(f"cannot drill: {exc}", EXIT_FAILED)
    except TimeoutError:
        fail(f"a drill did not play out within {timeout:g} s; see `lanes poc` for where it stands", EXIT_FAILED)
    if as_json:
        out.print_json(json.dumps({"drills": [report.as_json() for report in reports]}))
    else:
        for report in reports:
            print_report(report)
    if any(report.wrong for report in reports):
        raise typer.Exit(EXIT_FAILED)
