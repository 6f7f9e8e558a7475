"""`lanes requests` (request provenance) and `lanes route drain | ready` (an operator takes a replica out or back).

`lanes requests` reads LANES_REQUESTS, read-only, through the replay reader: a table by default, one
structured CloudEvent per line with --json. `lanes route` publishes an operator `replica_state` event on
the replica's job timeline; every router folds it (a drained replica takes no new requests, the ones in
flight finish).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from lanes_cli.console import EXIT_BAD_INPUT, EXIT_NOT_FOUND, as_utc, err, fail, load_settings, out, require, run_async
from lanes_cli.limits import excerpt
from lanes_cli.terminal import markup, print_json
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.codec import decode, to_structured
from lanes_contract.errors import DecodeError
from lanes_contract.events import (
    JobSubmitted,
    ReplicaState,
    ReplicaStateChanged,
    ReplicaStateChangedData,
    RequestAttempt,
    RequestServed,
)
from lanes_contract.ids import is_valid_token
from lanes_contract.jobs import ServingSpec
from lanes_contract.streams import JOBS, REQUESTS
from lanes_runtime.reader import Selection, iter_stream

SOURCE = "lanes/cli"
route_app = typer.Typer(
    help="Take an inference replica out of the routers' rotation, or put it back.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    """Add the router's commands to the `lanes` app."""
    app.command("requests")(requests)
    app.add_typer(route_app, name="route")


def _checked(value: str, what: str) -> str:
    if not is_valid_token(value):
        fail(f"{what} {excerpt(value)} must be 1-128 characters from A-Z a-z 0-9 _ -", EXIT_BAD_INPUT)
    return value


async def _read_requests(nats_url: str, selection: Selection) -> tuple[list[RequestServed], int]:
    nc = await connect_nats(nats_url, name="lanes-requests")
    events: list[RequestServed] = []
    unreadable = 0
    try:
        async for msg in iter_stream(nc.jetstream(), selection):
            try:
                event = decode(msg.subject, msg.headers, msg.data)
            except DecodeError:
                unreadable += 1
                continue
            if isinstance(event, RequestServed):
                events.append(event)
    finally:
        await nc.close()
    return events, unreadable


def requests(
    model: Annotated[str | None, typer.Option(help="Only this model's requests.")] = None,
    since: Annotated[
        datetime | None, typer.Option(help="Only requests stored at or after this time (RFC 3339).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="NDJSON: one structured CloudEvent per line.")] = False,
) -> None:
    """Show the provenance of inference requests: who served each, on what, how it went, every try.

    A stream continued on another replica shows `(moved Nx)` and, per try, the tokens it sent the client.
    """
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    subject = f"lanes.req.{_checked(model, 'model')}.>" if model else "lanes.req.>"
    selection = Selection(REQUESTS.name, subject, since=as_utc(since))
    events, unreadable = run_async(lambda: _read_requests(nats_url, selection))
    if unreadable:
        err.print(f"[yellow]{unreadable} stored message(s) could not be decoded and were skipped[/yellow]")
    if as_json:
        for event in events:
            sys.stdout.write(json.dumps(to_structured(event), separators=(",", ":"), ensure_ascii=False) + "\n")
        sys.stdout.flush()
        return
    if not events:
        err.print("no requests recorded" + (f" for model {model}" if model else ""))
        return
    out.print(_table(events))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def tries_text(attempts: tuple[RequestAttempt, ...], *, moved: bool) -> str:
    """Every try in order, `replica:outcome`; when the stream moved, each try's tokens as `[first:end)`.

    A moved stream reads as where it went and at which token, e.g. `a:failed_mid_stream[0:37) > b:ok[37:60)`.
    """
    parts = []
    for attempt in attempts:
        text = f"{attempt.replica}:{attempt.outcome}"
        if moved and attempt.first_token is not None:
            end = "" if attempt.tokens_sent is None else str(attempt.first_token + attempt.tokens_sent)
            text += f"[{attempt.first_token}:{end})"
        parts.append(text)
    return " > ".join(parts) or "-"


def _table(events: list[RequestServed]) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    for column in ("time", "request", "model", "replica", "node", "status", "http", "tries", "ttft ms", "ms", "tokens"):
        table.add_column(column, overflow="fold")
    for event in events:
        data = event.data
        tries = tries_text(data.attempts, moved=data.continuations > 0)
        tokens = f"{data.prompt_tokens if data.prompt_tokens is not None else '-'}/{data.completion_tokens or 0}"
        style = {"ok": "green", "failed": "red", "rejected": "yellow"}.get(data.status, "dim")
        moved = f" (moved {data.continuations}x)" if data.continuations else ""
        # A client names the request and the model: each cell of theirs is text, never markup or a control.
        table.add_row(
            data.received_at.strftime("%H:%M:%S.%f")[:-3],
            markup(data.request_id),
            markup(f"{data.model}@{data.version or '-'}"),
            markup(data.replica),
            markup(event.node or "-"),
            f"[{style}]{markup(data.status)}[/{style}]{moved}",
            str(data.http_status),
            markup(tries),
            _ms(data.ttft_ms),
            _ms(data.latency_ms),
            tokens,
        )
    return table


async def _serving_of(client: LanesClient, replica: str) -> ServingSpec | None:
    async for msg in iter_stream(client.js, Selection(JOBS.name, f"lanes.job.{replica}.submitted")):
        event = decode(msg.subject, msg.headers, msg.data)
        if isinstance(event, JobSubmitted):
            return event.data.spec.serving
    return None


def _set_state(replica: str, state: ReplicaState, reason: str) -> None:
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    replica = _checked(replica, "replica")

    async def send() -> tuple[int, ServingSpec]:
        async with await LanesClient.connect(nats_url, source=SOURCE) as client:
            serving = await _serving_of(client, replica)
            if serving is None:
                fail(f"unknown replica {replica!r}: no inference job {replica} was submitted", EXIT_NOT_FOUND)
            data = ReplicaStateChangedData(
                replica=replica,
                model=serving.model,
                version=serving.version,
                state=state,
                reason=reason,
                signal="operator",
            )
            # No attempt: it applies to whichever attempt of the job is serving now.
            seq = await client.publish(ReplicaStateChanged(source=client.source, jobid=replica, data=data))
            return seq, serving

    seq, serving = run_async(send)
    shown: dict[str, Any] = {"replica": replica, "model": serving.model, "version": serving.version}
    print_json(out, shown | {"state": state.value, "seq": seq})


@route_app.command()
def drain(
    replica: Annotated[str, typer.Argument(help="The replica (its inference job id).")],
    reason: Annotated[str, typer.Option(help="Why; shown on the job's timeline.")] = "",
) -> None:
    """Take a replica out of rotation: no new requests, the ones in flight finish (rollback, scale-down)."""
    _set_state(replica, ReplicaState.DRAINING, reason or "drained by an operator")


@route_app.command()
def ready(
    replica: Annotated[str, typer.Argument(help="The replica (its inference job id).")],
    reason: Annotated[str, typer.Option(help="Why; shown on the job's timeline.")] = "",
) -> None:
    """Put a drained replica back in rotation."""
    _set_state(replica, ReplicaState.READY, reason or "put back by an operator")
