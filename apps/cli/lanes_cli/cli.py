"""The `lanes` command line: demo, up, serve, submit, job, timeline, replay (exit codes: lanes_cli.console)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import asyncpg
import typer
import uvloop
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import ValidationError
from rich.markup import escape

# Typer carries its own copy of click: its exceptions are the ones a command line raises.
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError

from lanes_agent.faults import kernel_faults_unavailable
from lanes_agent.launcher import LocalLauncher
from lanes_cli import (
    agent_cli,
    analyze_cli,
    asyncapi_cli,
    audit_cli,
    console_cli,
    dead_cli,
    drill_cli,
    import_cli,
    incident_cli,
    jobs_cli,
    k8s_cli,
    poc_cli,
    policy_cli,
    recover_cli,
    router_cli,
    run_cli,
    slurm_cli,
    trace_cli,
    whatif_cli,
)
from lanes_cli.agent_cli import node_networks
from lanes_cli.bootstrap import SERVICES, prepare_services
from lanes_cli.console import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    cannot_write,
    checked_job_id,
    checked_window,
    err,
    fail,
    load_settings,
    one_line,
    out,
    output_file,
    require,
    run_async,
    signers_keyring,
)
from lanes_cli.demo import DEMO_NODES, FaultPaths, local_nodes, register_nodes, run_demo
from lanes_cli.html import render_page
from lanes_cli.input_files import InputFileError, load_yaml, validation_problems
from lanes_cli.limits import MAX_LOCAL_NODES, MAX_OPTION_SECONDS, MAX_STREAM_SEQUENCE, excerpt
from lanes_cli.render import render_demo, render_job
from lanes_cli.replay import Pace, merged, selections, write_ndjson
from lanes_cli.replicas import cluster_problem, service_replicas
from lanes_cli.scheduling import scheduling_view
from lanes_cli.stack import identity_url, servers, signing_exports
from lanes_cli.terminal import print_json
from lanes_cli.timeline import job_header, job_timeline
from lanes_cli.topology_cli import app as topology_app
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.events import JobSubmitted, JobSubmittedData
from lanes_contract.ids import derived_event_id, is_valid_token, new_event_id
from lanes_contract.jobs import JobSpec
from lanes_lifecycle import views as lifecycle_jobs
from lanes_router.entrypoints.runner import RouterRunner
from lanes_runtime.reader import count
from lanes_runtime.service import connected, run_consumers, settle_heap, stop_on_signals
from lanes_runtime.service import serve as serve_service
from lanes_runtime.settings import ENV_VARS, ServerUrls
from lanes_runtime.store import create_pool

_ENV_HELP = "\n".join(f"  {name}: {meaning}" for name, meaning in ENV_VARS.items())

app = typer.Typer(
    help=f"Lanes: the control plane and shared fault timeline for multi-node GPU work.\n\nEnvironment:\n\n{_ENV_HELP}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(topology_app, name="topology")
jobs_cli.register(app)
analyze_cli.register(app)
agent_cli.register(app)
drill_cli.register(app)
recover_cli.register(app)
router_cli.register(app)
whatif_cli.register(app)
policy_cli.register(app)
console_cli.register(app)
trace_cli.register(app)


@app.command()
def demo(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the swimlanes.")] = False,
    kernel_delay: Annotated[
        float,
        typer.Option(
            help="Hold the played OOM kill's kernel line back this many seconds (a slow agent).",
            min=0,
            max=MAX_OPTION_SECONDS,
        ),
    ] = 0.0,
    netns: Annotated[
        bool,
        typer.Option("--netns", help="Each node's ranks in a network namespace of its own, joined by a bridge (root)."),
    ] = False,
    kernel: Annotated[
        bool,
        typer.Option(
            "--kernel",
            help="Faults through this host's kernel (root): the OOM killer acts on a rank's memory cgroup, and the "
            "Xid line is written to /dev/kmsg, where the node agent reads it.",
        ),
    ] = False,
    export: Annotated[
        Path | None,
        typer.Option(
            "--export",
            help="After the scenario, write the job stream as NDJSON (the form `lanes replay` prints) to this file: "
            "the input of `lanes whatif recovery --from`.",
            dir_okay=False,
        ),
    ] = None,
) -> None:
    """Start embedded servers and every service, run the scripted multi-node scenario, print what happened."""
    if kernel and kernel_delay:
        fail("--kernel-delay holds back a played kernel line; the kernel's own cannot be held back", EXIT_BAD_INPUT)
    settings = load_settings(quiet=True)
    through_kernel = False
    if kernel:
        why = kernel_faults_unavailable()
        if why:
            err.print(f"--kernel: {why}; the OOM kill and the Xid line are played")
        through_kernel = why is None
    if export is not None:
        export = output_file(export, "--export")
        try:
            export.touch()  # a file the demo cannot write is refused now, not after a minute of scenario
        except OSError as exc:
            cannot_write(export, exc)
    networks = node_networks(list(DEMO_NODES)) if netns else None
    paths = FaultPaths(networks, through_kernel)
    try:
        with servers(settings) as urls:
            run = run_async(lambda: run_demo(urls, kernel_delay_s=kernel_delay, paths=paths, export=export))
    except KeyboardInterrupt:
        fail("interrupted; embedded servers stopped", 130)
    finally:
        if networks is not None:
            networks.down()
    if as_json:
        out.print_json(json.dumps(run.as_json()))
    else:
        render_demo(out, run)
    if problems := [*run.off_script(), *run.wrong_decisions()]:
        fail("; ".join(problems), EXIT_FAILED)


@app.command()
def up(
    nodes: Annotated[
        int, typer.Option(help="Simulated local nodes for the local launcher.", min=0, max=MAX_LOCAL_NODES)
    ] = 2,
    gpus: Annotated[int, typer.Option(help="GPUs per simulated node.", min=1, max=64)] = 4,
    kernel_log: Annotated[
        Path | None,
        typer.Option(
            help="Follow this kernel log (/dev/kmsg, as root): Xid, OOM-killer, ECC and link lines naming a rank's "
            "pid become that rank's evidence. Its resume position is kept in ~/.lanes/kmsg.position."
        ),
    ] = None,
    netns: Annotated[
        bool,
        typer.Option(
            "--netns",
            help="Each simulated node's ranks in a network namespace of its own, joined by a bridge (root): "
            "torch.distributed traffic crosses real links, and `lanes drill --kind link-down` cuts one.",
        ),
    ] = False,
    *,
    cluster: Annotated[
        int,
        typer.Option(
            help="Embed a NATS cluster of this many servers (3 or 5; 0: one server), the streams at R3, every "
            "write fsynced before it is acknowledged.",
            min=0,
            max=5,
        ),
    ] = 0,
    replicas: Annotated[
        int,
        typer.Option(
            help="Run this many processes of every service, each `lanes serve <service>` as its own identity "
            "(0: every service inside this process).",
            min=0,
            max=4,
        ),
    ] = 0,
) -> None:
    """Start embedded servers (unless the environment names yours) and every service, until Ctrl-C."""
    settings = load_settings()
    if problem := cluster_problem(cluster, nats_url_given=settings.nats_url is not None):
        fail(problem, EXIT_BAD_INPUT)
    stream_replicas = min(cluster, 3) or settings.stream_replicas

    async def serve_all(urls: ServerUrls) -> None:
        async with connected(urls, name="lanes-up", stream_replicas=stream_replicas) as conns:
            stop = stop_on_signals()
            fleet = local_nodes(nodes, gpus)
            await register_nodes(LanesClient(conns.nc, "lanes/up"), fleet)
            console_token = console_cli.viewer_token()  # the console's viewers show it (curl: Bearer)
            for name, value in (
                ("NATS_URL", urls.nats_url),
                ("DATABASE_URL", urls.database_url),
                ("REDIS_URL", urls.redis_url),
                *signing_exports(),  # the commands typed after these sign as the operator
                ("LANES_CONSOLE_TOKEN", console_token),
            ):
                out.print(f"export {name}={value}", highlight=False, soft_wrap=True)
            out.print(f"[dim]{len(fleet)} local nodes x {gpus} GPUs; Ctrl-C to stop[/dim]")
            launcher = LocalLauncher(
                conns.nc,
                frozenset(fleet),
                kernel_log=kernel_log,
                kernel_log_position=Path.home() / ".lanes" / "kmsg.position" if kernel_log else None,
                networks=networks,
            )
            if replicas:
                console_nc = await connect_nats(identity_url("console", urls.nats_url), name="lanes-console")
                try:
                    await service_replicas(urls, replicas, stream_replicas).beside(
                        stop, launcher.run(stop), console_cli.serve_beside(console_nc, stop, console_token)
                    )
                finally:
                    await console_nc.close()
                return
            consumers = await prepare_services(conns, SERVICES)
            router = next(consumer for consumer in consumers if isinstance(consumer, RouterRunner))

            async def announce_router() -> None:
                # A Ctrl-C before the router listens leaves nothing to announce, and must not be waited out.
                bound, stopped = asyncio.ensure_future(router.url()), asyncio.ensure_future(stop.wait())
                await asyncio.wait({bound, stopped}, return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
                if not bound.done():
                    bound.cancel()
                    return
                url = bound.result()
                out.print(f"router (OpenAI-compatible): {url}/v1/chat/completions", highlight=False, soft_wrap=True)

            # The console reads as its own identity, which may only read: what it serves cannot write the log.
            console_nc = await connect_nats(identity_url("console", urls.nats_url), name="lanes-console")
            settle_heap()
            try:
                await asyncio.gather(
                    run_consumers(consumers, stop),
                    launcher.run(stop),
                    announce_router(),
                    console_cli.serve_beside(console_nc, stop, console_token),
                )
            finally:
                await console_nc.close()

    networks = node_networks(list(local_nodes(nodes, gpus))) if netns else None
    try:
        with servers(settings, cluster=cluster) as urls:
            run_async(lambda: serve_all(urls))
    except KeyboardInterrupt:
        err.print("stopped")
    finally:
        if networks is not None:
            networks.down()


@app.command()
def serve(service: Annotated[str, typer.Argument(help=f"One of: {', '.join(SERVICES)}.")]) -> None:
    """Run one service against NATS_URL, DATABASE_URL and REDIS_URL until SIGTERM or Ctrl-C."""
    if service not in SERVICES:
        fail(f"unknown service {excerpt(service)}; choose one of {', '.join(SERVICES)}", EXIT_BAD_INPUT)
    settings = load_settings()
    urls = ServerUrls(
        require(settings.nats_url, "NATS_URL"),
        require(settings.database_url, "DATABASE_URL"),
        require(settings.redis_url, "REDIS_URL"),
    )

    # The router proxies every inference request: uvloop roughly halves its cost per request (bench/router.py).
    loop_factory = uvloop.new_event_loop if service == "router" else None
    try:
        run_async(
            lambda: serve_service(urls, SERVICES[service], stream_replicas=settings.stream_replicas),
            loop_factory=loop_factory,
        )
    except KeyboardInterrupt:
        err.print("stopped")


def spec_of(raw: Any) -> tuple[str | None, JobSpec]:
    """A job spec document's optional `job_id` and its validated spec; else InputFileError saying why."""
    if not isinstance(raw, dict):
        msg = f"must hold a mapping of job fields, not {type(raw).__name__}"
        raise InputFileError(msg)
    fields = dict(raw)
    job_id = fields.pop("job_id", None)
    if job_id is not None and not (isinstance(job_id, str) and is_valid_token(job_id)):
        msg = f"job_id {excerpt(str(job_id))} must be 1-128 characters from A-Z a-z 0-9 _ -"
        raise InputFileError(msg)
    try:
        return job_id, JobSpec.model_validate(fields)
    except ValidationError as exc:
        raise InputFileError(validation_problems(exc)) from exc


def load_spec(path: Path) -> tuple[str | None, JobSpec]:
    """Read a job spec file (YAML or JSON); return its optional `job_id` and the validated spec."""
    try:
        return spec_of(load_yaml(path))
    except InputFileError as exc:
        fail(f"{path}: {exc}", EXIT_BAD_INPUT)


@app.command()
def submit(spec_file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")]) -> None:
    """Submit a job. With `job_id` in the spec, submitting it again is a no-op."""
    settings = load_settings(quiet=True)
    job_id, spec = load_spec(spec_file)
    job_id = job_id or f"{spec.name}-{new_event_id()[-12:]}"
    nats_url = require(settings.nats_url, "NATS_URL")

    async def send() -> int:
        async with await LanesClient.connect(nats_url, source="lanes/cli") as client:
            event_id = derived_event_id(job_id, JobSubmitted.model_fields["type"].default)
            event = JobSubmitted(
                id=event_id, source=client.source, jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)
            )
            return await client.publish(event)

    seq = run_async(send)
    out.print_json(json.dumps({"job_id": job_id, "seq": seq}))


@app.command()
def job(
    job_id: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a job's state and attempts from the lifecycle projection."""
    checked_job_id(job_id)
    settings = load_settings(quiet=True)
    database_url = require(settings.database_url, "DATABASE_URL")

    async def load() -> dict[str, Any] | None:
        pool = await create_pool(database_url, max_size=1)
        try:
            async with pool.acquire() as conn:
                view = await lifecycle_jobs.load(conn, job_id)
                scheduling = await scheduling_view(conn, job_id)
        except asyncpg.UndefinedTableError:
            fail("DATABASE_URL holds no Lanes projection yet: no lifecycle service has run against it", EXIT_NOT_FOUND)
        finally:
            await pool.close()
        return None if view is None else jobs_cli.job_json(view) | {"scheduling": scheduling}

    view = run_async(load)
    if view is None:
        fail(f"unknown job {job_id!r}", EXIT_NOT_FOUND)
    if as_json:
        print_json(out, view)
        return
    jobs_cli.render_job_view(view)


@app.command()
def timeline(
    job_id: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    html_file: Annotated[Path | None, typer.Option("--html", help="Write a self-contained HTML page here.")] = None,
) -> None:
    """Read a job's timeline back from JetStream and show it grouped by lane (or as an HTML page).

    Each event shows its signer next to the source it claims, checked against LANES_KEYRING when it is set.
    """
    checked_job_id(job_id)
    if html_file is not None:
        output_file(html_file, "--html")
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")

    keyring = signers_keyring(settings)

    async def read() -> list[Any]:
        nc = await connect_nats(nats_url, name="lanes-timeline")
        try:
            return await job_timeline(nc.jetstream(), job_id, keyring)
        finally:
            await nc.close()

    entries = run_async(read)
    if not entries:
        fail(f"unknown job {job_id!r}: no events on lanes.job.{job_id}.>", EXIT_NOT_FOUND)
    report = {"job_id": job_id, "timeline": [e.as_json() for e in entries]}
    if html_file is not None:
        try:
            html_file.write_text(render_page(report))
        except OSError as exc:
            cannot_write(html_file, exc)
        err.print(f"wrote {html_file}")
    if as_json:
        print_json(out, report)
    elif html_file is None:
        render_job(out, job_header(job_id, entries), entries)


@app.command()
def replay(  # noqa: PLR0917 - typer maps each option to a parameter
    job: Annotated[str | None, typer.Option(help="One job's timeline (lanes.job.<id>.>).")] = None,
    node: Annotated[str | None, typer.Option(help="One node's events and telemetry, merged by time.")] = None,
    subject: Annotated[str | None, typer.Option(help="Any subject filter, e.g. 'lanes.job.*.rank_exited'.")] = None,
    stream: Annotated[str | None, typer.Option(help="The stream to read (default: from the selection).")] = None,
    from_seq: Annotated[
        int | None, typer.Option("--from-seq", min=1, max=MAX_STREAM_SEQUENCE, help="Start at this stream sequence.")
    ] = None,
    to_seq: Annotated[
        int | None, typer.Option("--to-seq", min=1, max=MAX_STREAM_SEQUENCE, help="Stop after this stream sequence.")
    ] = None,
    since: Annotated[datetime | None, typer.Option(help="Start at this time (RFC 3339).")] = None,
    until: Annotated[datetime | None, typer.Option(help="Stop after this time (RFC 3339).")] = None,
    pace: Annotated[str, typer.Option(help="instant, original, or xN (N times faster than original).")] = "instant",
    validate: Annotated[bool, typer.Option(help="Decode every event fully; report the invalid ones.")] = False,
) -> None:
    """Replay stored events as NDJSON structured CloudEvents on stdout; progress on stderr.

    Read-only: no durable consumer is left behind. Each line carries the CloudEvents `sequence` extension
    (the stream sequence), so an interrupted replay resumes with --from-seq.
    """
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    try:
        chosen = selections(job=job, node=node, subject=subject, stream=stream)
        pacing = Pace(pace)
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    if from_seq is not None and to_seq is not None and from_seq > to_seq:
        fail(f"--from-seq {from_seq} is after --to-seq {to_seq}: nothing lies between them", EXIT_BAD_INPUT)
    since, until = checked_window(since, until)
    chosen = [
        dataclasses.replace(selection, from_seq=from_seq, to_seq=to_seq, since=since, until=until)
        for selection in chosen
    ]

    async def run() -> int:
        nc = await connect_nats(nats_url, name="lanes-replay")
        try:
            js = nc.jetstream()
            if stream is not None:
                await _existing_stream(js, stream)
            total = sum([await count(js, selection) for selection in chosen])
            return await write_ndjson(merged(js, chosen), sys.stdout.buffer, pacing, total, validate=validate)
        finally:
            await nc.close()

    written = run_async(run)
    if written == 0 and job:
        fail(f"unknown job {job!r}: no events on lanes.job.{job}.>", EXIT_NOT_FOUND)


async def _existing_stream(js: JetStreamContext, name: str) -> None:
    """Exit 2 naming the streams there are when `--stream` names none of them."""
    try:
        await js.stream_info(name)
    except NotFoundError:
        names = sorted([info.config.name or "" for info in await js.streams_info()])
        fail(f"--stream {excerpt(name)}: no such stream; the streams are {', '.join(names)}", EXIT_BAD_INPUT)


app.add_typer(audit_cli.app, name="audit")
app.add_typer(dead_cli.app, name="dead")
app.add_typer(poc_cli.app, name="poc")
app.command()(asyncapi_cli.asyncapi)
app.command()(incident_cli.incident)
app.command("import")(import_cli.import_events)
app.command(context_settings={"allow_interspersed_args": False})(run_cli.run)
app.add_typer(slurm_cli.app, name="slurm")
app.add_typer(k8s_cli.app, name="k8s")


def main(args: list[str] | None = None) -> None:
    """Entry point of the `lanes` script (`args`: the command line, default sys.argv's); exits with its code.

    Every error is one line on stderr, a usage error included (exit codes: lanes_cli.console).
    """
    try:
        code = app(args=args, prog_name="lanes", standalone_mode=False)
    except KeyboardInterrupt:
        sys.exit(130)
    except NoArgsIsHelpError as exc:  # the help is already printed
        sys.exit(exc.exit_code)
    except UsageError as exc:
        where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        err.print(f"[red]error:[/red] {escape(one_line(exc.format_message()))}{escape(where)}", highlight=False)
        sys.exit(EXIT_BAD_INPUT)
    except ClickException as exc:
        err.print(f"[red]error:[/red] {escape(one_line(exc.format_message()))}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:
        # A bug, not a user's mistake: still one line (the traceback with LANES_LOG_LEVEL=debug).
        if os.environ.get("LANES_LOG_LEVEL", "").lower() == "debug":
            raise
        err.print(
            f"[red]error:[/red] {escape(one_line(f'unexpected {type(exc).__name__}: {exc}'))} "
            "(a bug in lanes; LANES_LOG_LEVEL=debug shows where)",
            highlight=False,
        )
        sys.exit(EXIT_FAILED)
    sys.exit(code if isinstance(code, int) else 0)
