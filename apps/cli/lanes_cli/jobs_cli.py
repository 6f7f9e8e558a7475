"""`lanes cancel | retry | jobs | projections rebuild`, and how `lanes job` shows a job's attempts.

Commands publish user commands onto the job's timeline (the lifecycle decides what they do, and an
illegal one shows up there as `transition_rejected`) or read the lifecycle projection.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import asyncpg
import typer

from lanes_cli.console import (
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    checked_job_id,
    fail,
    load_settings,
    out,
    require,
    run_async,
)
from lanes_cli.limits import MAX_ATTEMPT
from lanes_cli.terminal import markup, print_json, print_line
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.events import (
    CancelRequested,
    CommandData,
    Event,
    HoldRequested,
    HoldRequestedData,
    ResumeRequested,
    RetryData,
    RetryRequested,
)
from lanes_contract.ids import derived_event_id, new_event_id
from lanes_contract.jobs import JobState
from lanes_contract.streams import JOBS
from lanes_lifecycle import views as lifecycle_jobs
from lanes_lifecycle.views import JobView, verify
from lanes_runtime.reader import Selection, count
from lanes_runtime.store import create_pool

SOURCE = "lanes/cli"
projections_app = typer.Typer(help="Rebuild and verify projections from the log.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add the lifecycle's commands to the `lanes` app."""
    app.command()(cancel)
    app.command()(retry)
    app.command()(hold)
    app.command()(resume)
    app.command()(jobs)
    app.add_typer(projections_app, name="projections")


def job_json(view: JobView, *, now: datetime | None = None) -> dict[str, Any]:
    """A job as `lanes job --json` prints it: the view, plus time spent in each state up to now."""
    return view.model_dump(mode="json") | {"time_in_states": view.time_in_states(now or datetime.now(UTC))}


def render_job_view(job: dict[str, Any]) -> None:
    """`lanes job` for people: state and flags, each attempt with its cause and ranks, time per state.

    Causes, reasons, owners and node names come from events: every line goes out through `print_line`.
    """
    spec = job["spec"]
    flags = f" [{', '.join(job['flags'])}]" if job["flags"] else ""
    gpus = f"{spec['workers']}x{spec['gpus_per_worker']} GPUs"
    headline = f"{job['state']}{flags}  ({gpus})"
    out.print(f"[bold]{markup(job['job_id'])}[/bold] {markup(headline)}", highlight=False, emoji=False)
    if job.get("wait_reason"):
        print_line(out, f"  waiting: {job['wait_reason']} {job.get('wait_detail') or ''}")
    if job.get("manual"):
        manual = job["manual"]
        print_line(out, f"  awaiting {manual['owner']} until {manual['deadline'] or 'no deadline'}: {manual['reason']}")
    for attempt in job["attempts"]:
        nodes = ",".join(dict.fromkeys(p["node"] for p in attempt["placement"])) or "-"
        cause = f"  {attempt['cause']}: {attempt['cause_detail']}" if attempt["cause"] else ""
        if attempt.get("exit_cause"):
            cause += f" (refined by telemetry; the exits said {attempt['exit_cause']})"
        ckpt = attempt["last_checkpoint"]
        extra = f"  checkpoint step {ckpt['step']}" if ckpt else ""
        extra += f"  lost {attempt['lost_steps']} steps" if attempt["lost_steps"] else ""
        print_line(out, f"  attempt {attempt['number']}: {attempt['state']} on {nodes}{cause}{extra}")
        ranks = sorted(attempt["ranks"].values(), key=lambda r: r["rank"])
        for rank in ranks:
            how = ""
            if rank["exit_code"] is not None or rank["signal"] is not None:
                how = f" (exit {rank['exit_code']})" if rank["signal"] is None else f" (signal {rank['signal']})"
            print_line(out, f"    rank {rank['rank']} on {rank['node']}: {rank['state']}{how}")
    spent = ", ".join(f"{state} {seconds:.1f}s" for state, seconds in job["time_in_states"].items())
    print_line(out, f"  time in state: {spent}")


async def _publish_command(nats_url: str, job_id: str, build: type[Event], event_id: str, **fields: Any) -> int:
    async with await LanesClient.connect(nats_url, source=SOURCE) as client:
        if await count(client.js, Selection(JOBS.name, f"lanes.job.{job_id}.submitted")) == 0:
            fail(f"unknown job {job_id!r}: nothing was submitted on lanes.job.{job_id}", EXIT_NOT_FOUND)
        return await client.publish(build(id=event_id, source=client.source, jobid=job_id, **fields))


def _send_command(
    job_id: str, build: type[Event], *, event_id: str | None = None, shown: dict[str, Any] | None = None, **fields: Any
) -> None:
    """Publish a user command for a known job and print what was sent (`shown` adds keys to the output)."""
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    job_id = checked_job_id(job_id)
    sent_id = event_id or new_event_id()
    seq = run_async(lambda: _publish_command(nats_url, job_id, build, sent_id, **fields))
    command = build.name.removesuffix("_requested")
    print_json(out, {"job_id": job_id, "command": command, **(shown or {}), "seq": seq})


def cancel(
    job_id: str,
    reason: Annotated[str, typer.Option(help="Why; shown on the timeline.")] = "",
    by: Annotated[str, typer.Option(help="Who asks; shown on the timeline.")] = "",
) -> None:
    """Ask for a job to be cancelled: a queued job is cancelled at once, a running one stops its ranks first."""
    _send_command(job_id, CancelRequested, data=CommandData(reason=reason, requested_by=by))


def retry(
    job_id: str,
    attempt: Annotated[
        int | None,
        typer.Option(min=1, max=MAX_ATTEMPT, help="The attempt to retry; a stale one is rejected. Default: current."),
    ] = None,
    reason: Annotated[str, typer.Option(help="Why; shown on the timeline.")] = "",
    by: Annotated[str, typer.Option(help="Who asks; shown on the timeline.")] = "",
) -> None:
    """Ask for a new attempt of a failed or cancelled job (same job id, next attempt number)."""
    # Retrying a named attempt twice is one request (JetStream drops the second copy).
    event_id = derived_event_id(job_id, RetryRequested.model_fields["type"].default, str(attempt)) if attempt else None
    data = RetryData(reason=reason, requested_by=by)
    _send_command(job_id, RetryRequested, event_id=event_id, shown={"attempt": attempt}, attempt=attempt, data=data)


def hold(
    job_id: str,
    owner: Annotated[str, typer.Option(help="Who decides; default: the spec's owner for the failure's lane.")] = "",
    deadline: Annotated[
        datetime | None, typer.Option(help="When the decision is due (ISO 8601, UTC when no zone is given).")
    ] = None,
    reason: Annotated[str, typer.Option(help="Why; shown on the timeline.")] = "",
    by: Annotated[str, typer.Option(help="Who asks; shown on the timeline.")] = "",
) -> None:
    """Put a failed or cancelled job on the manual path (`awaiting_manual`): no retry until it is resumed."""
    due = deadline.replace(tzinfo=deadline.tzinfo or UTC) if deadline else None
    _send_command(
        job_id, HoldRequested, data=HoldRequestedData(reason=reason, requested_by=by, owner=owner, deadline=due)
    )


def resume(
    job_id: str,
    reason: Annotated[str, typer.Option(help="The decision; shown on the timeline.")] = "",
    by: Annotated[str, typer.Option(help="Who decides; shown on the timeline.")] = "",
) -> None:
    """Decide for a held job: start its next attempt."""
    _send_command(job_id, ResumeRequested, data=RetryData(reason=reason, requested_by=by))


def jobs(
    state: Annotated[
        list[JobState] | None, typer.Option("--state", help="Only jobs in this state (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List jobs from the lifecycle projection, newest change first."""
    settings = load_settings(quiet=True)
    database_url = require(settings.database_url, "DATABASE_URL")
    wanted = tuple(s.value for s in state or ())

    async def load() -> list[dict[str, Any]]:
        pool = await create_pool(database_url, max_size=1)
        try:
            async with pool.acquire() as conn:
                return await lifecycle_jobs.list_jobs(conn, states=wanted)
        except asyncpg.UndefinedTableError:
            fail("DATABASE_URL holds no Lanes projection yet: no lifecycle service has run against it", EXIT_NOT_FOUND)
        finally:
            await pool.close()

    rows = run_async(load)
    if as_json:
        print_json(out, {"jobs": rows})
        return
    for row in rows:
        flags = f" [{', '.join(row['flags'])}]" if row["flags"] else ""
        cause = f"  {row['cause']}" if row["cause"] else ""
        print_line(out, f"{row['job_id']}  {row['state']}{flags}  attempt {row['attempt']}{cause}")


@projections_app.command()
def rebuild(
    verify_: Annotated[
        bool, typer.Option("--verify", help="Diff against the live projection; exit 1 if unequal.")
    ] = False,
    schema: Annotated[str, typer.Option(help="Scratch schema to rebuild into.")] = "lanes_rebuild",
    keep: Annotated[bool, typer.Option(help="Keep the scratch schema afterwards.")] = False,
) -> None:
    """Replay LANES_JOBS through the lifecycle fold into a scratch schema (and with --verify, diff it)."""
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    database_url = require(settings.database_url, "DATABASE_URL")

    async def work() -> tuple[int, list[Any]]:
        nc = await connect_nats(nats_url, name="lanes-projections")
        pool = await create_pool(database_url, max_size=1)
        try:
            return await verify(nc.jetstream(), pool, schema=schema, keep=keep or not verify_)
        except LookupError as exc:
            fail(str(exc), EXIT_NOT_FOUND)
        finally:
            await pool.close()
            await nc.close()

    folded, differences = run_async(work)
    report = {"events_folded": folded, "schema": schema, "equal": not differences}
    if verify_:
        report["differences"] = [d.__dict__ for d in differences[:50]]
    out.print_json(json.dumps(report, default=str))
    if verify_ and differences:
        raise typer.Exit(EXIT_FAILED)
