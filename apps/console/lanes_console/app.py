"""The console's HTTP app: two pages and their live feeds, over one NATS connection that only reads.

- `GET /` the jobs list; `GET /jobs/<id>` a job's swimlanes. Each page is static HTML and a script from the
  package; the state of a view (job id, filters, `#seq=<n>`) is all in its URL, so a pasted link opens the same
  view.
- `GET /api/jobs` and `GET /api/jobs/<id>/events` are `text/event-stream`: the stored events first, then new
  ones as they are stored, each with `id: <stream sequence>`. A browser that reconnects sends `Last-Event-ID`
  and gets what came after it, no gap and no duplicate. Each feed has a reader's consumer of its own
  (`lanes_runtime.reader.follow`), deleted when the browser goes away.

Everything a page shows is sent as JSON and put in the page as text, never as markup; the pages forbid every
script, style and connection not from this server (Content-Security-Policy), so they load nothing from
elsewhere and run on an offline machine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import html
import io
import json
import os
import secrets
import tarfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import structlog
from aiohttp import web
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from lanes_console.actions import BadActionError, command_of
from lanes_console.attempts import Attempts, chosen_attempts
from lanes_console.incident import bundle_files, serves
from lanes_console.poc import ReportError, read_report, verdict_table
from lanes_console.rows import (
    FAILING_KINDS,
    JOBS_LIST_KINDS,
    MAX_QUERY_CHARS,
    BadQueryError,
    Consequences,
    Filters,
    FirstError,
    consequence_key,
    job_update,
    row_of,
    subject_kind,
)
from lanes_console.viewers import EVERYONE, Viewer, load_tenant_keys, viewer_of
from lanes_contract.client import LanesClient
from lanes_contract.codec import structured_line
from lanes_contract.ids import is_valid_token
from lanes_contract.streams import JOBS, NODES, REQUESTS, TELEMETRY
from lanes_runtime.reader import Mark, Selection, count, follow, iter_stream

log = structlog.get_logger(__name__)
NATS_KEY: web.AppKey[NatsClient] = web.AppKey("nats", NatsClient)
TOKEN_KEY: web.AppKey[str | None] = web.AppKey("token", str)
TENANTS_KEY: web.AppKey[dict[str, str]] = web.AppKey("tenants", dict)
VIEWER: web.RequestKey[Viewer] = web.RequestKey("viewer", Viewer)
"""Where a request carries the `Viewer` it was let in as."""
TENANTS_FILE_ENV = "LANES_CONSOLE_TENANTS_FILE"
POC_REPORT_ENV = "LANES_CONSOLE_POC_REPORT"
"""The `poc.json` of the last `lanes poc run --out DIR` that the POC page shows."""
OPERATOR_TOKEN_ENV = "LANES_CONSOLE_OPERATOR_TOKEN"  # noqa: S105 - the variable's name, not a token
OPERATOR_NATS_ENV = "LANES_CONSOLE_OPERATOR_NATS_URL"
OPERATOR_KEY: web.AppKey[Operator | None] = web.AppKey("operator", object)  # type: ignore[arg-type]
MAX_ACTION_BODY = 4096
TOKEN_ENV = "LANES_CONSOLE_TOKEN"  # noqa: S105 - the variable's name, not a token
"""The viewer token the console asks of every browser and client (`lanes up` makes one and exports it)."""
TOKEN_COOKIE = "lanes_console_token"  # noqa: S105 - the cookie's name, not a token
STATIC = Path(str(files("lanes_console") / "static"))
KEEPALIVE_S = 15.0
"""How often an idle feed sends an SSE comment: proxies keep the connection, a closed one is noticed."""
MAX_EVENT_ID = 2**63 - 1
SHUTDOWN_S = 1.0
ATTEMPTS_EVERY_S = 0.2
"""The attempts comparison is sent again at most this often while events change it (a storm is one update)."""
GROUPS_EVERY_S = 0.2
"""Likewise the job's grouped failures."""
PAGE_ROWS = 500
"""Stored rows a job feed sends when it opens (the newest the view keeps); earlier ones come a page at a time."""
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Operator:
    """What lets the console act: the operator token a request must show, and a client that may publish commands.

    The client connects as the identity the CLI uses (LANES_CONSOLE_OPERATOR_NATS_URL); the console's own
    connection stays read-only.
    """

    token: str
    client: LanesClient


def create_app(
    nc: NatsClient,
    token: str | None = None,
    tenants: Mapping[str, str] | None = None,
    operator: Operator | None = None,
) -> web.Application:
    """The console over a NATS connection that may read the log (the `console` identity).

    With a `token`, every page and feed asks for it (`_viewer`); without one (and without tenants), anyone who
    reaches the port reads. `tenants` (key SHA-256 -> tenant, `viewers.tenant_keys`) also lets in each
    tenant's API key, which sees that tenant's jobs only.
    """
    app = web.Application(middlewares=[_guard, _viewer])
    app[NATS_KEY] = nc
    app[TOKEN_KEY] = token
    app[TENANTS_KEY] = dict(tenants or {})
    app[OPERATOR_KEY] = operator
    app.router.add_get("/", jobs_page)
    app.router.add_get("/jobs/{job_id}", job_page)
    app.router.add_get("/api/jobs", jobs_feed)
    app.router.add_get("/api/jobs/{job_id}/events", job_feed)
    app.router.add_get("/jobs/{job_id}/attempts", attempts_page)
    app.router.add_get("/api/jobs/{job_id}/incident", incident_download)
    app.router.add_get("/api/jobs/{job_id}/rows", job_rows)
    app.router.add_post("/api/jobs/{job_id}/actions/{action}", job_action)
    app.router.add_get("/poc", poc_page)
    app.router.add_get("/api/poc", poc_table)
    app.router.add_get("/api/jobs/{job_id}/attempts", attempts_feed)
    app.router.add_get("/nodes/{node}", node_page)
    app.router.add_get("/api/nodes/{node}/events", node_feed)
    app.router.add_get("/replicas/{replica}/requests", requests_page)
    app.router.add_get("/api/replicas/{replica}/requests", requests_feed)
    app.router.add_static("/static/", STATIC, follow_symlinks=False)
    return app


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a huge query string before anything reads it, and send every answer with the page policy."""
    if len(request.query_string) > MAX_QUERY_CHARS:
        raise web.HTTPRequestURITooLong(text=f"the query string is over {MAX_QUERY_CHARS} characters")
    response = await handler(request)
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    return response


def viewer_token() -> str:
    """LANES_CONSOLE_TOKEN, or a fresh random token when it is not set."""
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)


def link(url: str, token: str) -> str:
    """The console's URL that a person can open: its `?token=` sets the cookie the pages then send."""
    return f"{url}?{urlencode({'token': token})}"


@web.middleware
async def _viewer(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Let in a request that carries the viewer token: `Authorization: Bearer`, the cookie, or `?token=`.

    A page opened with `?token=` sets the cookie (HttpOnly, same site only) and is sent again without it, so the
    token stays out of the address bar and the history; the page's feeds then carry the cookie.
    """
    token, keys, operator = request.app[TOKEN_KEY], request.app[TENANTS_KEY], request.app[OPERATOR_KEY]
    if request.path.startswith("/static/"):  # the assets are the package's, the same for all
        return await handler(request)
    if operator is not None and _is_operator(request, operator):
        request[VIEWER] = EVERYONE
        return await handler(request)
    if token is None and not keys:
        request[VIEWER] = EVERYONE
        return await handler(request)
    given = request.query.get("token")
    bearer = request.headers.get("Authorization", "")
    offered = [
        bearer.removeprefix("Bearer ").strip() if bearer.startswith("Bearer ") else "",
        request.cookies.get(TOKEN_COOKIE, ""),
        given or "",
    ]
    matched = next(
        ((credential, viewer) for credential in offered if (viewer := viewer_of(credential, token, keys))), None
    )
    if matched is None:
        raise web.HTTPUnauthorized(
            text=f"the console needs its viewer token ({TOKEN_ENV}) or a tenant's API key: Authorization: Bearer"
            " <token>, or ?token=<token> once in a browser",
            headers={"WWW-Authenticate": "Bearer"},
        )
    credential, request[VIEWER] = matched
    if given is not None and not request.path.startswith("/api/"):
        rest = urlencode([(key, value) for key, value in request.query.items() if key != "token"])
        seen = web.HTTPSeeOther(request.path + (f"?{rest}" if rest else ""))
        seen.set_cookie(TOKEN_COOKIE, credential, httponly=True, samesite="Strict", path="/")
        raise seen
    return await handler(request)


def _is_operator(request: web.Request, operator: Operator) -> bool:
    """Whether the request shows the operator token as `Authorization: Bearer` (never a cookie: no CSRF)."""
    bearer = request.headers.get("Authorization", "")
    return bearer.startswith("Bearer ") and hmac.compare_digest(
        bearer.removeprefix("Bearer ").strip().encode(), operator.token.encode()
    )


async def job_action(request: web.Request) -> web.Response:
    """`POST /api/jobs/<id>/actions/<action>` with `{"by": name, "reason": why}`: publish the operator's command.

    Only with the operator token (LANES_CONSOLE_OPERATOR_TOKEN) as a Bearer; a viewer's token or a tenant's key
    gets 403. The command is the one the CLI sends, so the services treat it the same, and it is on the job's
    timeline with `requested_by` "<name> (console)".
    """
    operator = request.app[OPERATOR_KEY]
    if operator is None:
        raise web.HTTPForbidden(
            text=f"this console takes no actions: it was started without {OPERATOR_TOKEN_ENV} and {OPERATOR_NATS_ENV}"
        )
    if not _is_operator(request, operator):
        raise web.HTTPForbidden(
            text=f"actions need the operator token ({OPERATOR_TOKEN_ENV}) as Authorization: Bearer; a viewer's token"
            " or a tenant's key may only look"
        )
    job_id = await _known_job(request)
    if request.content_length is None or request.content_length > MAX_ACTION_BODY:
        raise web.HTTPBadRequest(text=f"the body must be JSON of at most {MAX_ACTION_BODY} bytes: by, reason")
    try:
        body = json.loads(await request.read())
        command = command_of(request.match_info["action"], job_id, body, operator.client.source)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise web.HTTPBadRequest(text=f"the body is not JSON: {exc}") from exc
    except BadActionError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from exc
    if await count(request.app[NATS_KEY].jetstream(), Selection(JOBS.name, f"lanes.job.{job_id}.submitted")) == 0:
        raise web.HTTPNotFound(text=f"job {job_id!r} was never submitted: there is nothing to act on")
    seq = await operator.client.publish(command)
    log.info("operator action", job_id=job_id, action=request.match_info["action"], seq=seq)
    return web.json_response(
        {"job_id": job_id, "action": request.match_info["action"], "type": command.type, "seq": seq}
    )


def _viewer_of(request: web.Request) -> Viewer:
    viewer: Viewer = request.get(VIEWER, EVERYONE)  # set by _viewer on every request but the assets'
    return viewer


def _not_for_tenants(request: web.Request, what: str) -> None:
    viewer = _viewer_of(request)
    if viewer.tenant is not None:
        raise web.HTTPForbidden(
            text=f"{what} spans tenants: tenant {viewer.tenant}'s key opens that tenant's jobs only (the viewer"
            f" token, {TOKEN_ENV}, opens it)"
        )


def _page(name: str, **values: str) -> web.Response:
    text = (STATIC / name).read_text(encoding="utf-8")
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", html.escape(value, quote=True))
    return web.Response(text=text, content_type="text/html", charset="utf-8")


async def jobs_page(_request: web.Request) -> web.Response:
    """The jobs list (its rows come over /api/jobs)."""
    return _page("jobs.html")


async def job_page(request: web.Request) -> web.Response:
    """A job's swimlanes (its events come over /api/jobs/<id>/events, with the page's query string)."""
    job_id = await _known_job(request)
    _filters(request)  # a bad filter is refused here, not in a feed the page cannot read the reason of
    return _page("job.html", JOB_ID=job_id)


def _token(request: web.Request, key: str, what: str) -> str:
    value = request.match_info[key]
    if not is_valid_token(value):
        raise web.HTTPBadRequest(
            text=f"{value[:60]!r} is not a {what}: 1-128 characters from A-Z a-z 0-9 _ -, starting with a letter"
            " or digit"
        )
    return value


async def _known_job(request: web.Request, key: str = "job_id", what: str = "job id") -> str:
    job_id = _token(request, key, what)
    js = request.app[NATS_KEY].jetstream()
    if await count(js, Selection(JOBS.name, f"lanes.job.{job_id}.>")) == 0:
        raise web.HTTPNotFound(text=f"unknown job {job_id!r}: no events on lanes.job.{job_id}.>")
    viewer = _viewer_of(request)
    if viewer.tenant is not None:
        tenant = await _tenant_of(js, job_id)
        if tenant is None or not viewer.sees(tenant):
            # The same answer whether the job is another tenant's or has no submission: nothing about it leaks.
            raise web.HTTPForbidden(
                text=f"job {job_id!r} is not tenant {viewer.tenant}'s: this key opens that tenant's jobs only"
            )
    return job_id


async def _tenant_of(js: JetStreamContext, job_id: str) -> str | None:
    """The tenant the job was submitted for (its `submitted` event's spec), None before it is submitted."""
    async for msg in iter_stream(js, Selection(JOBS.name, f"lanes.job.{job_id}.submitted")):
        row = row_of(msg.metadata.sequence.stream, msg.subject, msg.headers, msg.data)
        return job_update(row).get("tenant")
    return None


def _node_streams(node: str) -> tuple[tuple[str, str], ...]:
    """Where a node's history is: its inventory and state changes, and the evidence its agent sent."""
    return ((NODES.name, f"lanes.node.{node}.>"), (TELEMETRY.name, f"lanes.tel.{node}.>"))


async def _known_node(request: web.Request) -> str:
    node = _token(request, "node", "node id")
    _not_for_tenants(request, "a node's history")
    js = request.app[NATS_KEY].jetstream()
    if not [1 for stream, subject in _node_streams(node) if await count(js, Selection(stream, subject))]:
        raise web.HTTPNotFound(text=f"unknown node {node!r}: no events on lanes.node.{node}.> or lanes.tel.{node}.>")
    return node


def _filters(request: web.Request) -> Filters:
    query = {key: request.query.get(key, "") for key in ("failures", "q")}
    query["lane"] = ",".join(request.query.getall("lane", []))
    try:
        return Filters.parse(query)
    except BadQueryError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from exc


def _last_event_id(request: web.Request) -> int:
    """The sequence the browser already has (`Last-Event-ID`, sent when it reconnects), 0 for none."""
    raw = request.headers.get("Last-Event-ID", "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) > MAX_EVENT_ID:
        raise web.HTTPBadRequest(text="Last-Event-ID must be a stream sequence (a whole number)")
    return int(raw)


class _Feed:
    """One SSE response: named events with ids, and comments while idle."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response
        self._idle_s = 0.0

    @classmethod
    async def open(cls, request: web.Request) -> _Feed:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # a buffering proxy in front would hold the live events back
                "Content-Security-Policy": CSP,
                "X-Content-Type-Options": "nosniff",
            }
        )
        await response.prepare(request)
        await response.write(b"retry: 1000\n\n")
        return cls(response)

    async def send(self, event: str, data: Any, event_id: int | str | None = None) -> None:
        # json.dumps escapes every control character, so one event is one `data:` line whatever it says.
        lines = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
        lines += f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
        self._idle_s = 0.0
        await self._response.write(lines.encode())

    async def idle(self, waited_s: float) -> None:
        self._idle_s += waited_s
        if self._idle_s >= KEEPALIVE_S:
            self._idle_s = 0.0
            await self._response.write(b": still here\n\n")


RowSink = Callable[[dict[str, Any]], Awaitable[None]]


async def _relay(
    request: web.Request,
    feed: _Feed,
    stream: str,
    subjects: tuple[str, ...],
    *,
    after: int,
    on_row: RowSink,
    on_caught_up: Callable[[], Awaitable[None]] | None = None,
    on_idle: Callable[[], Awaitable[None]] | None = None,
    on_message: Callable[[Msg], Awaitable[None]] | None = None,
) -> web.StreamResponse:
    """Follow one stream into an SSE feed until the browser goes: each message as a row, the catch-up once.

    The read starts after sequence `after` (0: at the start); `on_caught_up` defaults to a `caught_up` event;
    `on_message`, when given, gets each message as stored instead of `on_row` its row.
    """

    async def caught_up() -> None:
        await feed.send("caught_up", {"after": after})

    from_seq = after + 1 if after else None
    with contextlib.suppress(ConnectionResetError):
        async with contextlib.aclosing(follow(request.app[NATS_KEY], stream, subjects, from_seq)) as messages:
            async for msg in messages:
                if msg is Mark.IDLE:
                    if on_idle is not None:
                        await on_idle()
                    await feed.idle(1.0)
                elif msg is Mark.CAUGHT_UP:
                    await (on_caught_up or caught_up)()
                elif on_message is not None:
                    await on_message(msg)
                else:
                    await on_row(row_of(msg.metadata.sequence.stream, msg.subject, msg.headers, msg.data))
    return web.Response()  # not sent: the stream was prepared; only reached when the browser went away


async def job_feed(request: web.Request) -> web.StreamResponse:
    """A job's rows, stored then live (`row`), its first error (`first_error`) and its failures grouped (`groups`).

    The election and the groups see every row, also those the filters hide or the browser already has: the
    read always starts at the job's first event. Of the stored rows the view keeps, only the last PAGE_ROWS
    are sent, after a `page` event that says how many came before (the page asks /api/jobs/<id>/rows for
    them): a job of 100,000 events paints from its tail. Each failure row carries its group's key; the
    groups are sent again at most every GROUPS_EVERY_S while a storm changes them.
    """
    job_id = await _known_job(request)
    filters = _filters(request)
    after = _last_event_id(request)
    feed = await _Feed.open(request)
    election = FirstError()
    groups = Consequences()
    # The catch-up decodes only what it must: the events that can fail or elect (the election and the groups
    # read nothing else), and those a text or lane filter has to read. The rest are kept as stored, and only
    # the PAGE_ROWS sent are decoded: most of a long history is heartbeats nobody reads on the first paint.
    tail: collections.deque[dict[str, Any] | Msg] = collections.deque(maxlen=PAGE_ROWS)
    must_read_all = filters.pattern is not None or bool(filters.lanes)
    loop = asyncio.get_running_loop()
    state = {"caught_up": False, "kept": 0, "groups_changed": False, "groups_sent_at": 0.0}

    async def send_groups() -> None:
        if state["groups_changed"]:
            state["groups_changed"], state["groups_sent_at"] = False, loop.time()
            await feed.send("groups", groups.view(election.current))

    async def on_message(msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if state["caught_up"] or must_read_all or subject_kind(msg.subject) in FAILING_KINDS:
            await on_row(row_of(seq, msg.subject, msg.headers, msg.data))
        elif seq > after and not filters.failures:  # an event of another kind is no failure
            state["kept"] += 1
            tail.append(msg)

    async def on_row(row: dict[str, Any]) -> None:
        elected = election.add(row)
        if (key := groups.add(row)) is not None:
            row["group"] = key
            state["groups_changed"] = True
        if not state["caught_up"]:
            if row["seq"] > after and filters.keeps(row):
                state["kept"] += 1
                tail.append(row)
            return
        if elected:
            state["groups_changed"] = True
            await feed.send("first_error", election.current)
        if row["seq"] > after and filters.keeps(row):
            await feed.send("row", row, row["seq"])
        if loop.time() - state["groups_sent_at"] >= GROUPS_EVERY_S:
            await send_groups()

    async def on_caught_up() -> None:
        earlier = state["kept"] - len(tail)
        rows = [_grouped(_row_of(kept)) if isinstance(kept, Msg) else kept for kept in tail]
        tail.clear()
        await feed.send("page", {"earlier": earlier, "before": rows[0]["seq"] if rows else None})
        for row in rows:
            await feed.send("row", row, row["seq"])
        await feed.send("first_error", election.current)
        state["caught_up"], state["groups_changed"] = True, True
        await send_groups()
        await feed.send("caught_up", {"after": after})

    # From the job's first event whatever the browser has: the election needs them all.
    return await _relay(
        request,
        feed,
        JOBS.name,
        (f"lanes.job.{job_id}.>",),
        after=0,
        on_row=on_row,
        on_caught_up=on_caught_up,
        on_idle=send_groups,
        on_message=on_message,
    )


def _row_of(msg: Msg) -> dict[str, Any]:
    return row_of(msg.metadata.sequence.stream, msg.subject, msg.headers, msg.data)


def _bounded_int(request: web.Request, key: str, default: int, high: int) -> int:
    raw = request.query.get(key)
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= high:
        raise web.HTTPBadRequest(text=f"{key} must be a whole number from 1 to {high}")
    return int(raw)


def _grouped(row: dict[str, Any]) -> dict[str, Any]:
    """The row with its failure group's key, as the job feed sends it."""
    if (key := consequence_key(row)) is not None:
        row["group"] = key
    return row


async def job_rows(request: web.Request) -> web.Response:
    """A page of a job's stored rows before sequence `before` (`limit`, at most PAGE_ROWS), the view's filters on.

    JSON: `rows` in stream order and `more` (whether rows the view keeps come before them). The job's events
    are spread over a stream other jobs share: the read looks back over a window that doubles until it has
    `limit` rows or reaches the stream's start.
    """
    job_id = await _known_job(request)
    filters = _filters(request)
    if "before" not in request.query:
        raise web.HTTPBadRequest(
            text="before=<stream sequence> is needed: the page's first row, or the feed's page event"
        )
    before = _bounded_int(request, "before", MAX_EVENT_ID, MAX_EVENT_ID)
    limit = _bounded_int(request, "limit", PAGE_ROWS, PAGE_ROWS)
    js = request.app[NATS_KEY].jetstream()
    subject = f"lanes.job.{job_id}.>"
    window = limit * 4
    while True:
        start = max(1, before - window)
        kept = [
            _grouped(row)
            async for msg in iter_stream(js, Selection(JOBS.name, subject, from_seq=start, to_seq=before - 1))
            if filters.keeps(row := row_of(msg.metadata.sequence.stream, msg.subject, msg.headers, msg.data))
        ]
        if len(kept) >= limit or start == 1:
            return web.json_response({"rows": kept[-limit:], "more": len(kept) > limit or start > 1})
        window *= 2


def _chosen_attempts(request: web.Request) -> list[int]:
    try:
        return chosen_attempts(request.query.getall("attempt", []))
    except ValueError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from exc


async def attempts_page(request: web.Request) -> web.Response:
    """A job's attempts side by side (`?attempt=<n>&attempt=<m>`, default the last two): the URL is the view."""
    job_id = await _known_job(request)
    _chosen_attempts(request)
    return _page("attempts.html", JOB_ID=job_id)


async def attempts_feed(request: web.Request) -> web.StreamResponse:
    """The comparison of the chosen attempts (`attempts`), once caught up and again as new events change it.

    A storm changes it with every row: it is sent at most every ATTEMPTS_EVERY_S, the last change always
    (at the next row, or when the feed idles). Each comparison is whole, so it carries no id to resume from.
    """
    job_id = await _known_job(request)
    chosen = _chosen_attempts(request)
    feed = await _Feed.open(request)
    attempts = Attempts()
    loop = asyncio.get_running_loop()
    state = {"caught_up": False, "pending": False, "sent_at": 0.0}

    async def flush() -> None:
        if state["pending"]:
            state["pending"], state["sent_at"] = False, loop.time()
            await feed.send("attempts", attempts.view(chosen))

    async def on_row(row: dict[str, Any]) -> None:
        if attempts.add(row):
            state["pending"] = True
        if state["caught_up"] and loop.time() - state["sent_at"] >= ATTEMPTS_EVERY_S:
            await flush()

    async def on_caught_up() -> None:
        state["caught_up"], state["pending"] = True, True
        await flush()
        await feed.send("caught_up", {"after": 0})

    return await _relay(
        request,
        feed,
        JOBS.name,
        (f"lanes.job.{job_id}.>",),
        after=0,
        on_row=on_row,
        on_caught_up=on_caught_up,
        on_idle=flush,
    )


def _archive(job_id: str, job: dict[str, Any], lines: list[bytes], requests: list[dict[str, Any]]) -> bytes:
    """The bundle's files in one .tar.gz, under a directory named for the job."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name, content in bundle_files(job, lines, requests).items():
            member = tarfile.TarInfo(f"incident-{job_id}/{name}")
            member.size, member.mtime, member.mode = len(content), int(time.time()), 0o644
            tar.addfile(member, io.BytesIO(content))
    return archive.getvalue()


async def incident_download(request: web.Request) -> web.Response:
    """The job's incident bundle as `incident-<job>.tar.gz`: what `lanes incident <job> --out DIR` writes.

    incident.json (first error, evidence per lane, decision chain, timings, requests touched), timeline.html
    (the self-contained page) and events.ndjson (replayable with `lanes import`), read from the log now.
    """
    job_id = await _known_job(request)
    js = request.app[NATS_KEY].jetstream()
    rows: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    lines: list[bytes] = []

    async def read(selection: Selection, into: list[dict[str, Any]]) -> None:
        async for msg in iter_stream(js, selection):
            into.append(row_of(msg.metadata.sequence.stream, msg.subject, msg.headers, msg.data))
            lines.append(structured_line(msg.headers, msg.data, {"sequence": str(msg.metadata.sequence.stream)}))

    await read(Selection(JOBS.name, f"lanes.job.{job_id}.>"), rows)
    if rows and serves(rows) and rows[0].get("time"):
        # A request that failed over is stored under the replica that finally served it (as `lanes incident`).
        since = datetime.fromisoformat(str(rows[0]["time"]))
        await read(Selection(REQUESTS.name, "lanes.req.>", since=since), requests)
    # Building and compressing a large job's bundle takes CPU time: not in the loop that serves the live feeds.
    archive = await asyncio.to_thread(_archive, job_id, {"job_id": job_id, "timeline": rows}, lines, requests)
    return web.Response(
        body=archive,
        content_type="application/gzip",
        headers={
            "Content-Disposition": f'attachment; filename="incident-{job_id}.tar.gz"',
            "Cache-Control": "no-store",
        },
    )


async def poc_page(request: web.Request) -> web.Response:
    """The verdict table of the last POC run (its cells come over /api/poc)."""
    _not_for_tenants(request, "a POC run")
    return _page("poc.html")


async def poc_table(request: web.Request) -> web.Response:
    """The verdict table of the report LANES_CONSOLE_POC_REPORT names, read now; 404 saying how when there is none."""
    _not_for_tenants(request, "a POC run")
    path = os.environ.get(POC_REPORT_ENV, "")
    if not path:
        raise web.HTTPNotFound(
            text="no POC report: run `lanes poc run --out DIR` and start the console with"
            f" {POC_REPORT_ENV}=DIR/poc.json"
        )
    try:
        report = await asyncio.to_thread(read_report, Path(path))
    except ReportError as exc:
        raise web.HTTPNotFound(text=str(exc)) from exc
    return web.json_response(verdict_table(report))


async def node_page(request: web.Request) -> web.Response:
    """A node's history (its events come over /api/nodes/<node>/events)."""
    node = await _known_node(request)
    return _page("list.html", TITLE=f"node {node}", FEED=f"/api/nodes/{node}/events")


def _positions(request: web.Request, streams: tuple[str, ...]) -> dict[str, int]:
    """The last sequence the browser has of each stream: `Last-Event-ID` is `<seq>.<seq>` in `streams` order."""
    raw = request.headers.get("Last-Event-ID", "").strip()
    if not raw:
        return dict.fromkeys(streams, 0)
    parts = raw.split(".")
    if len(parts) != len(streams) or not all(p.isdigit() and int(p) <= MAX_EVENT_ID for p in parts):
        raise web.HTTPBadRequest(text=f"Last-Event-ID must be {len(streams)} stream sequences joined by '.'")
    return {stream: int(part) for stream, part in zip(streams, parts, strict=True)}


async def node_feed(request: web.Request) -> web.StreamResponse:
    """A node's events from both of its streams (`row`, each with `stream`), in the order they reach the console.

    Each event's id holds the last sequence sent of both streams, so a browser that reconnects resumes each
    stream where it was.
    """
    node = await _known_node(request)
    streams = _node_streams(node)
    positions = _positions(request, tuple(stream for stream, _ in streams))
    feed = await _Feed.open(request)
    arrived: asyncio.Queue[tuple[str, Msg | Mark]] = asyncio.Queue(maxsize=1024)

    async def pump(stream: str, subject: str) -> None:
        nc = request.app[NATS_KEY]
        async with contextlib.aclosing(follow(nc, stream, (subject,), positions[stream] + 1)) as messages:
            async for msg in messages:
                await arrived.put((stream, msg))

    pumps = [asyncio.create_task(pump(stream, subject)) for stream, subject in streams]
    caught_up: set[str] = set()
    try:
        with contextlib.suppress(ConnectionResetError):
            while True:
                stream, msg = await arrived.get()
                if msg is Mark.IDLE:
                    await feed.idle(1.0 / len(streams))
                elif msg is Mark.CAUGHT_UP:
                    caught_up.add(stream)
                    if len(caught_up) == len(streams):
                        await feed.send("caught_up", positions)
                else:
                    positions[stream] = msg.metadata.sequence.stream
                    row = row_of(positions[stream], msg.subject, msg.headers, msg.data) | {"stream": stream}
                    await feed.send("row", row, ".".join(str(positions[s]) for s, _ in streams))
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    return web.Response()


async def _known_replica(request: web.Request) -> str:
    # A replica is an inference job: a tenant's key opens the requests of its own replicas only.
    replica = (
        await _known_job(request, "replica", "replica id")
        if _viewer_of(request).tenant is not None
        else _token(request, "replica", "replica id")
    )
    if await count(request.app[NATS_KEY].jetstream(), Selection(REQUESTS.name, f"lanes.req.*.{replica}")) == 0:
        raise web.HTTPNotFound(text=f"no request served by replica {replica!r}: nothing on lanes.req.*.{replica}")
    return replica


async def requests_page(request: web.Request) -> web.Response:
    """The requests a replica (an inference job) served, with their provenance: what its fault touched."""
    replica = await _known_replica(request)
    return _page("list.html", TITLE=f"requests served by {replica}", FEED=f"/api/replicas/{replica}/requests")


async def requests_feed(request: web.Request) -> web.StreamResponse:
    """A replica's requests (`row`, each with `stream`), stored then live; `Last-Event-ID` resumes."""
    replica = await _known_replica(request)
    after = _last_event_id(request)
    feed = await _Feed.open(request)

    async def on_row(row: dict[str, Any]) -> None:
        await feed.send("row", row | {"stream": REQUESTS.name}, row["seq"])

    return await _relay(request, feed, REQUESTS.name, (f"lanes.req.*.{replica}",), after=after, on_row=on_row)


async def jobs_feed(request: web.Request) -> web.StreamResponse:
    """Every job's name, state and first-error lane, as the events that set them are stored (`job`)."""
    after = _last_event_id(request)
    feed = await _Feed.open(request)

    viewer = _viewer_of(request)
    tenants: dict[str, str | None] = {}
    """job -> tenant, from each job's submission (which comes before any other event of the job)."""

    async def on_row(row: dict[str, Any]) -> None:
        if not row.get("job_id"):
            return
        update = job_update(row)
        if row.get("kind") == "submitted":
            tenants[row["job_id"]] = update.get("tenant")
        if row["seq"] <= after or (viewer.tenant is not None and tenants.get(row["job_id"]) != viewer.tenant):
            return
        await feed.send("job", update, row["seq"])

    async def caught_up() -> None:
        await feed.send("caught_up", {"after": after})

    subjects = tuple(f"lanes.job.*.{kind}" for kind in JOBS_LIST_KINDS)
    # A tenant's viewer that reconnects is sent what came after its Last-Event-ID, but the read starts at the
    # beginning all the same: the submissions say which jobs are the tenant's.
    start = 0 if viewer.tenant is not None else after
    return await _relay(request, feed, JOBS.name, subjects, after=start, on_row=on_row, on_caught_up=caught_up)


async def serve(  # noqa: PLR0917 - the app's parts, each optional
    nc: NatsClient,
    host: str,
    port: int,
    token: str | None = None,
    tenants: Mapping[str, str] | None = None,
    operator: Operator | None = None,
) -> tuple[web.AppRunner, str]:
    """Start the console on host:port (0: a free port); the runner to clean up and the URL it answers on."""
    # A browser that closes the page cancels its feed's handler at once, and with it the feed's consumer. A feed
    # never ends by itself, so a stopping console cancels the open ones after SHUTDOWN_S instead of waiting.
    runner = web.AppRunner(
        create_app(nc, token, tenants, operator),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_S,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    address = runner.addresses[0]  # where it bound: with port 0, the port the system picked
    shown = f"[{address[0]}]" if ":" in address[0] else address[0]
    return runner, f"http://{shown}:{address[1]}/"


def tenant_keys_from_env() -> dict[str, str]:
    """The tenants whose API keys may view their own jobs: LANES_CONSOLE_TENANTS_FILE (the router's file), or none."""
    path = os.environ.get(TENANTS_FILE_ENV, "")
    return load_tenant_keys(path) if path else {}


async def serve_until(
    nc: NatsClient, host: str, port: int, *, stop: asyncio.Event, on_ready: Callable[[str], None], token: str
) -> None:
    """Serve the console until `stop` is set, asking for `token` (or a tenant's key, LANES_CONSOLE_TENANTS_FILE).

    `on_ready` gets the link to open, once it answers.
    """
    operator_token, operator_url = os.environ.get(OPERATOR_TOKEN_ENV, ""), os.environ.get(OPERATOR_NATS_ENV, "")
    if bool(operator_token) != bool(operator_url):
        msg = f"operator actions need both {OPERATOR_TOKEN_ENV} and {OPERATOR_NATS_ENV} (or neither)"
        raise ValueError(msg)
    client = await LanesClient.connect(operator_url, source="lanes/console") if operator_url else None
    operator = Operator(operator_token, client) if client is not None else None
    try:
        runner, url = await serve(nc, host, port, token, tenant_keys_from_env(), operator)
        try:
            on_ready(link(url, token))
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        if client is not None:
            await client.close()
