"""The `lanes` command line: demo, up, serve, submit, job, timeline.

Exit codes: 0 success, 1 the work itself failed, 2 bad input (usage, spec file), 3 unknown job,
4 a server is unreachable or unsupported.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import asyncpg
import typer
import yaml
from lanes_common.bus import LanesClient, connect_nats
from lanes_common.errors import LanesError, ServerUnavailableError, UnsupportedServerError
from lanes_common.events import JobSubmitted, JobSubmittedData
from lanes_common.ids import derived_event_id, is_valid_token, new_event_id
from lanes_common.jobs import JobSpec
from lanes_common.log import configure_logging
from lanes_common.settings import ENV_VARS, ServerUrls, Settings
from lanes_common.store import create_pool
from lanes_lifecycle.adapters import repository as lifecycle_jobs
from pydantic import ValidationError
from rich.console import Console

from lanes_ops.bootstrap import SERVICES, connected, prepare_services, run_consumers
from lanes_ops.demo import local_nodes, register_nodes, run_demo
from lanes_ops.launcher import LocalLauncher
from lanes_ops.render import render_job
from lanes_ops.stack import servers
from lanes_ops.timeline import job_timeline

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NOT_FOUND, EXIT_SERVER = 1, 2, 3, 4
_ENV_HELP = "\n".join(f"  {name}: {meaning}" for name, meaning in ENV_VARS.items())

app = typer.Typer(
    help=f"Lanes: the control plane and shared fault timeline for multi-node GPU work.\n\nEnvironment:\n\n{_ENV_HELP}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)
_T = TypeVar("_T")


def _fail(message: str, code: int) -> NoReturn:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _settings(*, quiet: bool = False) -> Settings:
    try:
        settings = Settings.from_env()
    except ValueError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    # Commands whose output is the point (demo, submit, job, timeline) log only warnings unless asked to.
    level = settings.log_level if (os.environ.get("LANES_LOG_LEVEL") or not quiet) else "warning"
    configure_logging(level, settings.log_format)
    return settings


def _run(work: Callable[[], Awaitable[_T]]) -> _T:
    """Run async work; turn server problems into one-line errors and SIGTERM into a clean shutdown."""

    def on_sigterm(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return asyncio.run(work())  # type: ignore[arg-type]
    except (ServerUnavailableError, UnsupportedServerError) as exc:
        _fail(str(exc), EXIT_SERVER)
    except LanesError as exc:
        _fail(str(exc), EXIT_FAILED)


def _require(value: str | None, name: str) -> str:
    if not value:
        _fail(
            f"{name} is not set: start `lanes up` and export the URLs it prints, or point it at your server",
            EXIT_BAD_INPUT,
        )
    return value


@app.command()
def demo(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the swimlanes.")] = False,
) -> None:
    """Start embedded servers and all five services, run a 2-node x 4-GPU job to the end, print its timeline."""
    settings = _settings(quiet=True)
    try:
        with servers(settings) as urls:
            report, entries = _run(lambda: run_demo(urls))
    except KeyboardInterrupt:
        _fail("interrupted; embedded servers stopped", 130)
    if as_json:
        out.print_json(json.dumps({"jobs": [report]}))
        return
    render_job(out, report, entries)
    if report["state"] != "released":
        raise typer.Exit(EXIT_FAILED)


@app.command()
def up(
    nodes: Annotated[int, typer.Option(help="Simulated local nodes for the local launcher.", min=0)] = 2,
    gpus: Annotated[int, typer.Option(help="GPUs per simulated node.", min=1, max=64)] = 4,
) -> None:
    """Start embedded servers (unless the environment names yours) and every service, until Ctrl-C."""
    settings = _settings()

    async def serve_all(urls: ServerUrls) -> None:
        async with connected(urls, name="lanes-up", stream_replicas=settings.stream_replicas) as conns:
            stop = _stop_on_signals()
            fleet = local_nodes(nodes, gpus)
            await register_nodes(LanesClient(conns.nc, "lanes/up"), fleet)
            for name, value in (
                ("NATS_URL", urls.nats_url),
                ("DATABASE_URL", urls.database_url),
                ("REDIS_URL", urls.redis_url),
            ):
                out.print(f"export {name}={value}", highlight=False, soft_wrap=True)
            out.print(f"[dim]{len(fleet)} local nodes x {gpus} GPUs; Ctrl-C to stop[/dim]")
            consumers = await prepare_services(conns, SERVICES)
            launcher = LocalLauncher(conns.nc, frozenset(fleet))
            await asyncio.gather(run_consumers(consumers, stop), launcher.run(stop))

    try:
        with servers(settings) as urls:
            _run(lambda: serve_all(urls))
    except KeyboardInterrupt:
        err.print("stopped")


@app.command()
def serve(service: Annotated[str, typer.Argument(help=f"One of: {', '.join(SERVICES)}.")]) -> None:
    """Run one service against NATS_URL, DATABASE_URL and REDIS_URL until SIGTERM or Ctrl-C."""
    if service not in SERVICES:
        _fail(f"unknown service {service!r}; choose one of {', '.join(SERVICES)}", EXIT_BAD_INPUT)
    settings = _settings()
    urls = ServerUrls(
        _require(settings.nats_url, "NATS_URL"),
        _require(settings.database_url, "DATABASE_URL"),
        _require(settings.redis_url, "REDIS_URL"),
    )

    async def serve_one() -> None:
        async with connected(urls, name=f"lanes-{service}", stream_replicas=settings.stream_replicas) as conns:
            await run_consumers(await prepare_services(conns, [service]), _stop_on_signals())

    try:
        _run(serve_one)
    except KeyboardInterrupt:
        err.print("stopped")


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def load_spec(path: Path) -> tuple[str | None, JobSpec]:
    """Read a job spec file (YAML or JSON); return its optional `job_id` and the validated spec."""
    try:
        raw: Any = yaml.safe_load(path.read_text())
    except OSError as exc:
        _fail(f"cannot read {path}: {exc.strerror}", EXIT_BAD_INPUT)
    except yaml.YAMLError as exc:
        _fail(f"{path} is not valid YAML: {exc}", EXIT_BAD_INPUT)
    if not isinstance(raw, dict):
        _fail(f"{path} must hold a mapping of job fields, not {type(raw).__name__}", EXIT_BAD_INPUT)
    job_id = raw.pop("job_id", None)
    if job_id is not None and not (isinstance(job_id, str) and is_valid_token(job_id)):
        _fail(f"{path}: job_id {job_id!r} must be 1-128 characters from A-Z a-z 0-9 _ -", EXIT_BAD_INPUT)
    try:
        return job_id, JobSpec.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())
        _fail(f"{path}: {problems}", EXIT_BAD_INPUT)


@app.command()
def submit(spec_file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")]) -> None:
    """Submit a job. With `job_id` in the spec, submitting it again is a no-op."""
    settings = _settings(quiet=True)
    job_id, spec = load_spec(spec_file)
    job_id = job_id or f"{spec.name}-{new_event_id()[-12:]}"
    nats_url = _require(settings.nats_url, "NATS_URL")

    async def send() -> int:
        async with await LanesClient.connect(nats_url, source="lanes/cli") as client:
            event_id = derived_event_id(job_id, JobSubmitted.model_fields["type"].default)
            event = JobSubmitted(
                id=event_id, source=client.source, jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)
            )
            return await client.publish(event)

    seq = _run(send)
    out.print_json(json.dumps({"job_id": job_id, "seq": seq}))


@app.command()
def job(
    job_id: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a job's state and attempts from the lifecycle projection."""
    settings = _settings(quiet=True)
    database_url = _require(settings.database_url, "DATABASE_URL")

    async def load() -> dict[str, Any] | None:
        pool = await create_pool(database_url, max_size=1)
        try:
            async with pool.acquire() as conn:
                view = await lifecycle_jobs.load(conn, job_id)
        except asyncpg.UndefinedTableError:
            _fail("DATABASE_URL holds no Lanes projection yet: no lifecycle service has run against it", EXIT_NOT_FOUND)
        finally:
            await pool.close()
        return None if view is None else view.model_dump(mode="json")

    view = _run(load)
    if view is None:
        _fail(f"unknown job {job_id!r}", EXIT_NOT_FOUND)
    if as_json:
        out.print_json(json.dumps(view))
        return
    spec = view["spec"]
    out.print(f"[bold]{view['job_id']}[/bold] {view['state']}  ({spec['workers']}x{spec['gpus_per_worker']} GPUs)")
    for attempt in view["attempts"]:
        out.print(f"  attempt {attempt['number']}: {attempt['state']}  {attempt.get('cause') or ''}")


@app.command()
def timeline(
    job_id: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Read a job's timeline back from JetStream and show it grouped by lane."""
    settings = _settings(quiet=True)
    nats_url = _require(settings.nats_url, "NATS_URL")

    async def read() -> list[Any]:
        nc = await connect_nats(nats_url, name="lanes-timeline")
        try:
            return await job_timeline(nc.jetstream(), job_id)
        finally:
            await nc.close()

    entries = _run(read)
    if not entries:
        _fail(f"unknown job {job_id!r}: no events on lanes.job.{job_id}.>", EXIT_NOT_FOUND)
    if as_json:
        out.print_json(json.dumps({"job_id": job_id, "timeline": [e.as_json() for e in entries]}))
        return
    render_job(out, {"job_id": job_id}, entries)


def main() -> None:
    """Entry point of the `lanes` script."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
