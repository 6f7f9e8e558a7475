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
from collections.abc import Coroutine
from datetime import timedelta
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
from lanes_cli.drills import (
    REPLICA_DRILLS,
    DrillReport,
    ReplicaDrillReport,
    complete,
    drill_report,
    replica_drill_report,
)
from lanes_cli.input_files import load_yaml, validation_problems
from lanes_cli.limits import MAX_OPTION_SECONDS, MAX_RANKS
from lanes_cli.timeline import job_timeline, read_stream, row_kind
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.events import (
    DrillInjected,
    DrillInjectedData,
    DrillKind,
    ReplicaState,
    ReplicaStateChanged,
    ReplicaStateChangedData,
)
from lanes_contract.jobs import Token
from lanes_contract.streams import REQUESTS
from lanes_runtime.reader import Selection

Row = dict[str, Any]
_POLL_S = 0.5
_STREAM_HORIZON = timedelta(minutes=30)
"""How far before a replica drill the requests it may have cut are looked for: no stream lasts longer here."""


class DrillStep(BaseModel):
    """One drill of a plan."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    job: Token
    kind: DrillKind
    rank: int = Field(default=0, ge=0)
    """The rank to drill (a replica drill takes rank 0, its server)."""
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


def _serving(rows: list[Row], replica: str) -> tuple[str, str]:
    """The (model, version) an inference job serves, or a FaultError: replica drills need a replica."""
    submitted = next((row for row in rows if row_kind(row) == "submitted"), None)
    serving = (((submitted or {}).get("data") or {}).get("spec") or {}).get("serving")
    if not serving:
        msg = f"job {replica} is not an inference replica (no serving spec): replica-* drills need one"
        raise FaultError(msg)
    return str(serving["model"]), str(serving["version"])


async def _drain(
    client: LanesClient, replica: str, served: tuple[str, str], duration_s: float | None, drill_id: str
) -> str:
    """Take the replica out of rotation as `lanes route drain` does; back in after `duration_s`, if given."""
    model, version = served

    async def set_state(state: ReplicaState, reason: str) -> None:
        data = ReplicaStateChangedData(
            replica=replica, model=model, version=version, state=state, reason=reason, signal="operator"
        )
        await client.publish(ReplicaStateChanged(source=client.source, jobid=replica, data=data))

    await set_state(ReplicaState.DRAINING, f"drill {drill_id}: drained with streams in flight")
    if duration_s is None:
        return "drained, left out of rotation"
    await asyncio.sleep(duration_s)
    await set_state(ReplicaState.READY, f"drill {drill_id}: back in rotation")
    return f"drained, back in rotation after {duration_s:g} s"


async def run_replica_drill(
    client: LanesClient, step: DrillStep, *, timeout_s: float, by: str = ""
) -> ReplicaDrillReport:
    """Kill, pause or drain an inference replica (`step.job`); wait (at most `timeout_s`) for its streams.

    The drill has played out once it is over (a pause resumed, a drain's duration past) and the streams the
    replica had in flight are recorded; a drill with no stream in flight times out.
    """
    js = client.js
    rows = await _rows(js, step.job)
    if not rows:
        msg = f"unknown replica {step.job!r}: no events on lanes.job.{step.job}.>"
        raise UnknownJobError(msg)
    served = _serving(rows, step.job)
    attempt, node, pid = running_rank(rows, 0)
    if step.kind is not DrillKind.REPLICA_DRAIN and process_start(pid) is None:
        msg = f"replica {step.job}'s process {pid} is not running on this host (run the drill on its node)"
        raise FaultError(msg)
    announced = DrillInjectedData(
        kind=step.kind, node=node, rank=0, pid=pid, duration_s=step.duration_s, requested_by=by
    )
    event = DrillInjected(source="lanes/cli", jobid=step.job, attempt=attempt, node=node, rank=0, data=announced)
    await client.publish(event)  # before the fault: its time is the start of every measure
    if step.kind is DrillKind.REPLICA_DRAIN:
        injecting = asyncio.create_task(_drain(client, step.job, served, step.duration_s, event.id))
    else:
        fault = DrillKind.KILL if step.kind is DrillKind.REPLICA_KILL else DrillKind.HANG
        injecting = asyncio.create_task(_detail(inject(fault, pid, node=node, duration_s=step.duration_s)))
    requests = Selection(REQUESTS.name, f"lanes.req.{served[0]}.>", since=event.time - _STREAM_HORIZON)
    async with asyncio.timeout(timeout_s):
        while True:
            if injecting.done():
                injecting.result()  # a fault that could not be injected is said now, not hidden behind a timeout
            drilled = next(row for row in await _rows(js, step.job) if row.get("id") == event.id)
            report = replica_drill_report(drilled, [e.as_json() for e in await read_stream(js, requests)])
            if report.in_flight and injecting.done():
                break
            await asyncio.sleep(_POLL_S)
    return report


async def _detail(injecting: Coroutine[Any, Any, Any]) -> str:
    return str((await injecting).detail)


def _print(report: DrillReport | ReplicaDrillReport) -> None:
    if isinstance(report, ReplicaDrillReport):
        print_replica_report(report)
    else:
        print_report(report)


def print_replica_report(report: ReplicaDrillReport) -> None:
    """One line per replica drill: what became of the streams it had in flight."""
    moved = f" on {', '.join(report.took_over)} at tokens {list(report.moved_at)}" if report.continued else ""
    first = "" if report.first_move_s is None else f"; first moved after {report.first_move_s:.1f} s"
    lost = f"[red]{len(report.errored)} errored[/red]" if report.errored else "[green]none lost[/green]"
    out.print(
        f"{report.where}: {len(report.in_flight)} streams in flight; {len(report.continued)} continued{moved}, "
        f"{len(report.finished_in_place)} finished in place, {lost}{first}",
        highlight=False,
    )


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
    job: Annotated[
        str | None, typer.Argument(help="The running job, or inference replica, to drill (or give --plan).")
    ] = None,
    kind: Annotated[DrillKind | None, typer.Option(help="What to inject.")] = None,
    rank: Annotated[int, typer.Option(help="Into which rank of the running attempt.", min=0, max=MAX_RANKS - 1)] = 0,
    duration: Annotated[
        float | None,
        typer.Option(
            help="Seconds a hang, slow, link-slow, replica-pause or replica-drain lasts.",
            min=0.1,
            max=MAX_OPTION_SECONDS,
        ),
    ] = None,
    plan: Annotated[
        Path | None, typer.Option(help="A YAML file of drills (job, kind, rank, duration_s; a replica needs no rank).")
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for each drill to play out.", min=1, max=MAX_OPTION_SECONDS)
    ] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Inject a real fault (kill, hang, slow, oom, xid, exception, link-down, link-slow); judge the answer.

    On an inference replica: replica-kill, replica-pause or replica-drain with streams in flight; judged by
    what became of those streams.
    """
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

    async def run_all() -> list[DrillReport | ReplicaDrillReport]:
        nc = await connect_nats(url, name="lanes-drill")
        try:
            client = LanesClient(nc, "lanes/cli")
            reports: list[DrillReport | ReplicaDrillReport] = []
            for step in steps:
                if step.kind in REPLICA_DRILLS:
                    reports.append(await run_replica_drill(client, step, timeout_s=timeout, by=getpass.getuser()))
                else:
                    reports.append(await run_drill(client, step, timeout_s=timeout, by=getpass.getuser()))
            return reports
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
            _print(report)
    if any(report.lost if isinstance(report, ReplicaDrillReport) else report.wrong for report in reports):
        raise typer.Exit(EXIT_FAILED)
