"""The router's HTTP front: the OpenAI-compatible API of vLLM-like servers, proxied to replicas.

`/v1/chat/completions` and `/v1/completions` (streaming over SSE or not; bodies passed through),
`/v1/models`, `/healthz`, `/readyz`, `/metrics`. A request is tried on another replica while no byte has
reached the client (bounded by `max_attempts`, unless the spec's failover policy says `connect_failure:
fail`). Once a stream has started, a failing replica's stream is continued on another ready replica of
the same model and version (the prompt plus the text already sent, see `domain.continuation`), up to the
spec's `max_continuations`; a model that cannot continue (or a stream past its moves) ends with an SSE
error event and `[DONE]`. Every request leaves one `RequestServed` event, built and published off the
request's path, with every replica it used and the token index where it moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import aiohttp
from aiohttp import web

from lanes_contract.events import (
    UNROUTED,
    RequestAttempt,
    RequestServed,
    RequestServedData,
    utc_now,
)
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import ServingSpec
from lanes_router.adapters.metrics import RouterMetrics
from lanes_router.domain.continuation import (
    LegRewriter,
    NotContinuableError,
    continuation_body,
    read_sent,
    split_whole_events,
)
from lanes_router.domain.health import Outcome, counts_against_replica
from lanes_router.domain.replicas import Replica, ReplicaRegistry
from lanes_router.domain.requests import (
    MODEL_NOT_FOUND,
    VERSION_HEADER,
    BadRequestError,
    InferenceRequest,
    Refusal,
    parse_inference_request,
)
from lanes_router.domain.tenants import UNAUTHENTICATED, TenantLimits, bearer_key
from lanes_router.entrypoints.config import RouterConfig, load_tenants
from lanes_router.service_layer.dispatch import Dispatcher, Granted
from lanes_router.service_layer.health import HealthMonitor

REQUEST_ID_HEADER = "X-Request-Id"
REPLICA_HEADER = "X-Lanes-Replica"
_PASSED_HEADERS = ("Authorization", "Accept", "traceparent")
_DONE = b"data: [DONE]\n\n"
_BUSY = frozenset({429, 503})
CHAT_ROUTE = "/v1/chat/completions"
_CLIENT_GONE = "client gone"
"""What `_pump` returns when the client hung up (compared by identity, never shown)."""


def _may_continue(spec: ServingSpec) -> bool:
    """Whether a stream of this deployment may move to another replica after its first token."""
    failover = spec.failover
    moves = failover.mid_stream == "continue_elsewhere" and failover.max_continuations > 0
    return moves and spec.continuation != "none"


@dataclass(slots=True, eq=False)
class _Leg:
    """One replica's part of a client's stream (hashed by identity: the live streams are a set of legs)."""

    replica: Replica
    upstream: aiohttp.ClientResponse
    first: bytes
    started: float
    sent: list[bytes] | None = None
    """The whole events the client has received (shared by every leg), when the stream may move."""
    first_token: int = 0
    """The index of the first token this leg sent the client."""
    rewriter: LegRewriter | None = None
    """Set on a continuation: makes its events read as the first leg's stream."""
    cut: str = ""
    """Why the router cut this leg itself (its replica's node was lost), when it did."""


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def error_body(http_status: int, error_type: str, message: str) -> dict[str, Any]:
    """The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": http_status}}


UNKNOWN_MODEL = "(not served)"
"""The one metrics label of every request for a model that is not served, whatever name it gave."""


def error_response(http_status: int, error_type: str, message: str, retry_after_s: int | None = None) -> web.Response:
    """A JSON error answer, with `Retry-After` when the client should come back."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return web.json_response(error_body(http_status, error_type, message), status=http_status, headers=headers)


def refusal_response(refusal: Refusal) -> web.Response:
    """The answer of a refusal (protection mode, tenant limits, authentication)."""
    return error_response(refusal.http_status, refusal.error_type, refusal.message, refusal.retry_after_s)


@dataclass
class _Served:
    """What one client request went through, filled in as it goes (becomes its `RequestServed`)."""

    request_id: str
    route: str
    received_at: datetime
    started: float
    tenant: str | None = None
    model: str = ""
    version: str | None = None
    stream: bool = False
    replica: Replica | None = None
    status: str = "failed"
    http_status: int = 500
    error: str = ""
    attempts: list[RequestAttempt] = field(default_factory=list)
    first_byte: float | None = None
    finished: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    model_unknown: bool = False
    parsed: InferenceRequest | None = None
    continuations: int = 0


class _StreamMeter:
    """Reads token counts out of SSE chunks as they pass: the `usage` event when sent, else the event count."""

    def __init__(self) -> None:
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.done = False
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        if not self._partial and chunk.endswith(b"\n\n") and b'"usage"' not in chunk and b"[DONE]" not in chunk:
            self.events += chunk.count(b"data:")  # the common case: whole token events, nothing to parse
            return
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            self.events += 1
            if b'"usage"' in payload:
                try:
                    usage = json.loads(payload).get("usage")
                except (ValueError, AttributeError):
                    continue
                if isinstance(usage, dict):
                    self.usage = usage


class RouterHttp:
    """The aiohttp application of one router process."""

    def __init__(
        self,
        *,
        config: RouterConfig,
        registry: ReplicaRegistry,
        dispatcher: Dispatcher,
        health: HealthMonitor,
        submit_provenance: Callable[[Callable[[], RequestServed]], None],
        metrics: RouterMetrics,
        source: str,
        router_name: str,
        ready: Callable[[], bool],
    ) -> None:
        self._config = config
        self._registry = registry
        self._dispatcher = dispatcher
        self._health = health
        self._submit = submit_provenance
        self._metrics = metrics
        self._source = source
        self._router_name = router_name
        self._ready = ready
        self._tenants = load_tenants(config.tenants_file)
        self._limits = TenantLimits()
        self._session: aiohttp.ClientSession | None = None
        self._live: dict[str, set[_Leg]] = {}
        """The streams each replica is sending now, so a lost replica's streams move at once."""
        connect = config.connect_timeout_s
        self._stream_timeout = aiohttp.ClientTimeout(sock_connect=connect, sock_read=config.stream_idle_timeout_s)
        self._whole_timeout = aiohttp.ClientTimeout(sock_connect=connect)

    def application(self) -> web.Application:
        """The routes, and one keep-alive client session for the upstream calls (closed with the app)."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics_text)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def _close_session(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions")

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if (refused := self._admin_refusal(request)) is not None:
            return refused
        # Ready = the registry is rebuilt and the shared state answers (checked now, bounded), so a router
        # whose Redis is down or stopped leaves the load balancer's pool, and comes back on its own.
        shared_state = await self._dispatcher.shared_state_answers()
        ready = self._ready() and shared_state
        replicas = self._registry.all()
        body = {
            "ready": ready,
            "shared_state": shared_state,
            "replicas": len(replicas),
            "routable": sum(1 for r in replicas if r.routable),
        }
        return web.json_response(body, status=200 if ready else 503)

    async def _metrics_text(self, request: web.Request) -> web.Response:
        if (refused := self._admin_refusal(request)) is not None:
            return refused
        return web.Response(text=self._metrics.render(), content_type="text/plain", charset="utf-8")

    async def _models(self, request: web.Request) -> web.Response:
        # With tenants configured, what is served is told only to a tenant or the admin.
        if self._tenants is not None:
            key = bearer_key(request.headers.get("Authorization"))
            if self._tenants.tenant_of(key) is None and not self._tenants.is_admin(key):
                return refusal_response(UNAUTHENTICATED)
        data = []
        for model in self._registry.models():
            replicas = self._registry.of_model(model)
            versions: dict[str, dict[str, int]] = {}
            for replica in replicas:
                counts = versions.setdefault(replica.version, {"ready": 0, "replicas": 0, "weight": 0})
                counts["replicas"] += 1
                counts["ready"] += int(replica.routable)
                counts["weight"] = replica.serving.weight
            data.append({"id": model, "object": "model", "created": 0, "owned_by": "lanes", "versions": versions})
        return web.json_response({"object": "list", "data": data})

    # --- the proxy -------------------------------------------------------------------------------------

    async def _serve(self, request: web.Request, route: str) -> web.StreamResponse:
        # With tenants configured, a request names its tenant by its API key and is held to the tenant's
        # rate and concurrency before anything else is done for it.
        if self._tenants is None:
            return await self._serve_admitted(request, route, None)
        tenant = self._tenants.tenant_of(bearer_key(request.headers.get("Authorization")))
        if tenant is None:
            return refusal_response(UNAUTHENTICATED)
        refused = self._limits.admit(tenant, time.monotonic())
        if refused is not None:
            return refusal_response(refused)
        try:
            return await self._serve_admitted(request, route, tenant.name)
        finally:
            self._limits.release(tenant)

    def _admin_refusal(self, request: web.Request) -> web.Response | None:
        """The 401 for an admin route asked without the admin key (when tenants are configured)."""
        if self._tenants is None or self._tenants.is_admin(bearer_key(request.headers.get("Authorization"))):
            return None
        return error_response(401, "admin_key_required", "this route needs the admin key: Authorization: Bearer")

    async def _serve_admitted(self, request: web.Request, route: str, tenant: str | None) -> web.StreamResponse:
        served = _Served(self._request_id(request), route, utc_now(), time.perf_counter(), tenant=tenant)
        body = await request.read()
        try:
            parsed = parse_inference_request(
                body, request.headers.get(VERSION_HEADER), affinity=self._config.prefix_affinity
            )
        except BadRequestError as exc:
            # Bad input gets its answer here and never reaches the log.
            return error_response(400, "invalid_request_error", str(exc))
        served.model, served.version, served.stream = parsed.model, parsed.version, parsed.stream
        served.parsed = parsed
        self._metrics.in_flight += 1
        try:
            response = await self._route(request, parsed, served)
        except asyncio.CancelledError:
            served.status, served.http_status = "client_closed", 499
            raise
        else:
            if not parsed.stream and _client_gone(request):
                # The client hung up while the replica answered: the answer is computed but nobody gets it.
                served.status = "client_closed"
            return response
        finally:
            self._metrics.in_flight -= 1
            served.finished = time.perf_counter()
            if served.model_unknown:
                # A name is anyone's to make up: its 404 is counted under one label and leaves no event, so
                # made-up names grow neither /metrics nor LANES_REQUESTS.
                latency_s = served.finished - served.started
                self._metrics.request_done(UNKNOWN_MODEL, served.status, served.http_status, latency_s, None)
            else:
                self._submit(lambda: self._provenance(served))

    async def _route(self, request: web.Request, parsed: InferenceRequest, served: _Served) -> web.StreamResponse:
        tried: set[str] = set()
        while len(served.attempts) < self._config.max_attempts:
            granted = await self._dispatcher.acquire(parsed, frozenset(tried))
            if isinstance(granted, Refusal):
                served.model_unknown = granted.error_type == MODEL_NOT_FOUND
                # After failed tries the protection mode still answers (no other replica has room), and the
                # message says what the tries met.
                message = granted.message + (f"; {_last_failure(served)}" if served.attempts else "")
                served.status, served.http_status, served.error = "rejected", granted.http_status, message
                return error_response(granted.http_status, granted.error_type, message, granted.retry_after_s)
            try:
                answered = await self._forward(request, parsed, granted, served)
            finally:
                self._dispatcher.release(granted)
            if answered is not None:
                return answered
            tried.add(granted.replica.replica_id)
            if granted.replica.serving.failover.connect_failure == "fail":
                break  # the deployment asked for its failures, not for another replica
        message = f"no replica could answer in {len(served.attempts)} tries; {_last_failure(served)}"
        served.status, served.http_status, served.error = "failed", 502, message
        return error_response(502, "upstream_failed", message)

    def _attempt(
        self,
        served: _Served,
        replica: Replica,
        outcome: Outcome,
        started: float,
        *,
        http_status: int | None = None,
        detail: str = "",
        leg: _Leg | None = None,
        total: int | None = None,
    ) -> None:
        """Record one try; `leg` (a stream's) and `total` (tokens the client has) place it in the stream."""
        first_token = tokens_sent = None
        if leg is not None:
            first_token = leg.first_token
            tokens_sent = None if total is None else max(0, total - first_token)
        served.attempts.append(
            RequestAttempt(
                replica=replica.replica_id,
                node=replica.node,
                outcome=outcome,
                detail=detail[:500],
                http_status=http_status,
                elapsed_ms=(time.perf_counter() - started) * 1000,
                first_token=first_token,
                tokens_sent=tokens_sent,
            )
        )
        self._metrics.attempt_done(replica.model, replica.replica_id, outcome)
        self._health.report(replica, outcome, counts=counts_against_replica(outcome, http_status))

    async def _forward(
        self, request: web.Request, parsed: InferenceRequest, granted: Granted, served: _Served
    ) -> web.StreamResponse | None:
        """Send the request to the granted replica; None when it failed before any byte reached the client."""
        replica = granted.replica
        assert replica.endpoint is not None  # noqa: S101 - only routable replicas are granted
        assert self._session is not None  # noqa: S101 - opened on startup
        headers = self._upstream_headers(request, served)
        limit = self._config.first_token_timeout_s if parsed.stream else self._config.request_timeout_s
        started = time.perf_counter()
        upstream: aiohttp.ClientResponse | None = None
        first: bytes | None = None
        payload = b""
        try:
            async with asyncio.timeout(limit):
                upstream = await self._session.post(
                    replica.endpoint + served.route,
                    data=parsed.body,
                    headers=headers,
                    timeout=self._stream_timeout if parsed.stream else self._whole_timeout,
                )
                if parsed.stream and upstream.status == 200:  # noqa: PLR2004 - HTTP OK
                    first = await upstream.content.readany()
                    if not first:
                        raise aiohttp.ServerDisconnectedError("the stream ended before its first event")
                else:
                    payload = await upstream.read()
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            outcome: Outcome = "timeout" if isinstance(exc, TimeoutError) else "refused"
            self._attempt(served, replica, outcome, started, detail=str(exc) or type(exc).__name__)
        except TimeoutError:
            outcome = "slow_first_token" if parsed.stream else "timeout"
            self._attempt(served, replica, outcome, started, detail=f"no answer within {limit:g}s")
        except aiohttp.ClientError as exc:
            self._attempt(served, replica, "error", started, detail=str(exc) or type(exc).__name__)
        else:
            try:
                if first is not None:
                    return await self._relay_stream(
                        request=request, upstream=upstream, first=first, granted=granted, served=served, started=started
                    )
                return self._relay_whole(upstream, payload, granted, served, started)
            finally:
                upstream.release()
        if upstream is not None:
            upstream.close()
        return None

    @staticmethod
    def _upstream_headers(request: web.Request, served: _Served) -> dict[str, str]:
        """What a replica is sent: the request id (the same on every try) and the client's passed headers."""
        headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: served.request_id}
        for name in _PASSED_HEADERS:
            if (value := request.headers.get(name)) is not None:
                headers[name] = value
        return headers

    def _relay_whole(
        self, upstream: aiohttp.ClientResponse, payload: bytes, granted: Granted, served: _Served, started: float
    ) -> web.Response | None:
        replica = granted.replica
        status = upstream.status
        if status >= 500 or status in _BUSY:  # noqa: PLR2004 - server errors
            outcome: Outcome = "refused" if status in _BUSY else "error"
            self._attempt(
                served, replica, outcome, started, http_status=status, detail=payload[:300].decode(errors="replace")
            )
            return None
        self._attempt(served, replica, "ok", started, http_status=status)
        served.first_byte = time.perf_counter()
        served.replica, served.http_status = replica, status
        served.status = "ok" if status < 400 else "failed"  # noqa: PLR2004 - HTTP client errors pass through
        if served.status == "failed":
            served.error = payload[:300].decode(errors="replace")
        elif b'"usage"' in payload:
            self._read_usage(served, payload)
        return web.Response(
            body=payload,
            status=status,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                REPLICA_HEADER: replica.replica_id,
                VERSION_HEADER: replica.version,
                REQUEST_ID_HEADER: served.request_id,
            },
        )

    @staticmethod
    def _read_usage(served: _Served, payload: bytes) -> None:
        try:
            usage = json.loads(payload).get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            served.prompt_tokens = _count(usage.get("prompt_tokens"))
            served.completion_tokens = _count(usage.get("completion_tokens"))

    async def _relay_stream(
        self,
        *,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        granted: Granted,
        served: _Served,
        started: float,
    ) -> web.StreamResponse:
        replica = granted.replica
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                REPLICA_HEADER: replica.replica_id,
                VERSION_HEADER: replica.version,
                REQUEST_ID_HEADER: served.request_id,
            },
        )
        served.replica, served.http_status = replica, 200
        meter = _StreamMeter()
        # The events sent are kept only when the stream may move, and read back only when it does.
        leg = _Leg(replica, upstream, first, started, sent=[] if _may_continue(replica.serving) else None)
        try:
            await response.prepare(request)
        except ConnectionResetError:
            return self._client_closed(response, served, meter, leg)
        served.first_byte = time.perf_counter()
        grants: list[Granted] = []
        try:
            while True:
                failure = await self._pump(response, leg, meter)
                if failure is _CLIENT_GONE:
                    return self._client_closed(response, served, meter, leg)
                if failure is None:
                    break
                next_leg = await self._move(
                    request=request,
                    response=response,
                    leg=leg,
                    served=served,
                    meter=meter,
                    failure=failure,
                    grants=grants,
                )
                if next_leg is None:
                    return response
                leg = next_leg
        finally:
            for held in grants:
                self._dispatcher.release(held)
        served.status = "ok"
        self._usage_from(meter, served)
        self._attempt(served, leg.replica, "ok", leg.started, http_status=200, leg=leg, total=served.completion_tokens)
        try:
            await response.write_eof()
        except ConnectionResetError:
            served.status = "client_closed"
        return response

    async def _pump(self, response: web.StreamResponse, leg: _Leg, meter: _StreamMeter) -> str | None:
        """Relay one replica's events to the client: None at [DONE], else why the replica failed.

        Only whole SSE events are written (a partial tail waits for the rest), so a replica that dies
        mid-event leaves no half event for a continuation to follow.
        """
        chunk, held, sent, rewriter = leg.first, b"", leg.sent, leg.rewriter
        live = self._live.setdefault(leg.replica.replica_id, set())
        live.add(leg)
        try:
            while chunk:
                if held or not (chunk.endswith((b"\n\n", b"\r\n\r\n"))):
                    chunk, held = split_whole_events(held + chunk)
                if chunk:
                    if rewriter is not None:
                        chunk = rewriter.rewrite(chunk)
                    meter.feed(chunk)
                    if sent is not None:
                        sent.append(chunk)
                    try:
                        await response.write(chunk)
                    except ConnectionResetError:
                        return _CLIENT_GONE
                # A silent replica is caught by the session's read timeout (`sock_read`), not a timer per chunk.
                chunk = await leg.upstream.content.readany()
        except (aiohttp.ClientError, ConnectionResetError, TimeoutError) as exc:
            return leg.cut or str(exc) or type(exc).__name__
        finally:
            live.discard(leg)
            leg.upstream.release()
        if leg.cut:
            return leg.cut
        if held:
            meter.feed(held)
            try:
                await response.write(held)
            except ConnectionResetError:
                return _CLIENT_GONE
        return None if meter.done else "the replica closed the stream before [DONE]"

    async def _move(
        self,
        *,
        request: web.Request,
        response: web.StreamResponse,
        leg: _Leg,
        served: _Served,
        meter: _StreamMeter,
        failure: str,
        grants: list[Granted],
    ) -> _Leg | None:
        """Continue a stream whose replica failed on another one; None once the stream has been ended."""
        replica = leg.replica
        if leg.sent is None:
            self._usage_from(meter, served)
            total = served.completion_tokens
            self._attempt(
                served, replica, "failed_mid_stream", leg.started, http_status=200, detail=failure, leg=leg, total=total
            )
            await self._end_stream_with_error(response, replica, served, failure)
            return None
        so_far = read_sent(leg.sent)
        served.completion_tokens = so_far.tokens
        tokens = so_far.tokens
        self._attempt(
            served, replica, "failed_mid_stream", leg.started, http_status=200, detail=failure, leg=leg, total=tokens
        )
        if so_far.finished:
            # Every token was sent; only the closing events were lost. The client's answer is whole.
            try:
                await response.write(_DONE)
            except ConnectionResetError:
                served.status = "client_closed"
                return None
            served.status = "ok"
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
            return None
        if served.continuations >= replica.serving.failover.max_continuations:
            why = f"it moved {served.continuations} times, the most its spec allows"
            await self._end_stream_with_error(response, replica, served, failure, why)
            return None
        parsed = served.parsed
        assert parsed is not None  # noqa: S101 - set before routing
        try:
            body = continuation_body(parsed.body, so_far, chat=served.route == CHAT_ROUTE)
        except NotContinuableError as exc:
            await self._end_stream_with_error(response, replica, served, failure, str(exc))
            return None
        # The same model and version, never a replica this request already used.
        tried = frozenset(a.replica for a in served.attempts)
        again = replace(parsed, version=replica.version, body=body, stream=True)
        while True:
            granted = await self._dispatcher.acquire(again, tried)
            if isinstance(granted, Refusal):
                why = f"no other replica could continue it ({granted.message})"
                await self._end_stream_with_error(response, replica, served, failure, why)
                return None
            grants.append(granted)
            started = time.perf_counter()
            opened = await self._open_stream(request, again, granted, served, started, first_token=so_far.tokens)
            if opened is not None:
                break
            tried = tried | {granted.replica.replica_id}
        upstream, first = opened
        served.continuations += 1
        served.replica = granted.replica
        return _Leg(
            granted.replica,
            upstream,
            first,
            started,
            sent=leg.sent,
            first_token=so_far.tokens,
            rewriter=LegRewriter(so_far),
        )

    async def _open_stream(
        self,
        request: web.Request,
        parsed: InferenceRequest,
        granted: Granted,
        served: _Served,
        started: float,
        *,
        first_token: int,
    ) -> tuple[aiohttp.ClientResponse, bytes] | None:
        """A continuation's upstream stream and its first bytes, or None (the try is recorded) when it failed."""
        replica = granted.replica
        assert replica.endpoint is not None  # noqa: S101 - only routable replicas are granted
        assert self._session is not None  # noqa: S101 - opened on startup
        upstream: aiohttp.ClientResponse | None = None
        detail, outcome = "", "error"
        try:
            async with asyncio.timeout(self._config.first_token_timeout_s):
                upstream = await self._session.post(
                    replica.endpoint + served.route,
                    data=parsed.body,
                    headers=self._upstream_headers(request, served),
                    timeout=self._stream_timeout,
                )
                if upstream.status == 200:  # noqa: PLR2004 - HTTP OK
                    first = await upstream.content.readany()
                    if first:
                        return upstream, first
                    detail = "the stream ended before its first event"
                else:
                    detail = f"HTTP {upstream.status}: " + (await upstream.read())[:300].decode(errors="replace")
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            outcome, detail = "refused", str(exc) or type(exc).__name__
        except TimeoutError:
            outcome = "slow_first_token"
            detail = f"no answer within {self._config.first_token_timeout_s:g}s"
        except aiohttp.ClientError as exc:
            detail = str(exc) or type(exc).__name__
        except BaseException:
            if upstream is not None:  # the client left while the stream was moving: free the connection
                upstream.close()
            raise
        if upstream is not None:
            upstream.close()
        status = None if upstream is None else upstream.status
        self._attempt(served, replica, outcome, started, http_status=status, detail=detail)  # type: ignore[arg-type]
        served.attempts[-1] = served.attempts[-1].model_copy(update={"first_token": first_token, "tokens_sent": 0})
        return None

    def _client_closed(
        self, response: web.StreamResponse, served: _Served, meter: _StreamMeter, leg: _Leg
    ) -> web.StreamResponse:
        served.status = "client_closed"
        self._usage_from(meter, served)
        total = served.completion_tokens
        self._attempt(served, leg.replica, "client_closed", leg.started, http_status=200, leg=leg, total=total)
        return response

    async def _end_stream_with_error(
        self,
        response: web.StreamResponse,
        replica: Replica,
        served: _Served,
        detail: str,
        not_continued: str = "",
    ) -> None:
        """End the client's stream with an SSE error event and [DONE] (the try is already recorded)."""
        message = f"replica {replica.replica_id} failed mid-stream: {detail}"
        if not_continued:
            message += f"; not continued: {not_continued}"
        served.status, served.error = "failed", message
        error = json.dumps(error_body(502, "upstream_failed", message))
        try:
            await response.write(f"data: {error}\n\n".encode() + _DONE)
            await response.write_eof()
        except ConnectionResetError:
            served.status = "client_closed"

    @staticmethod
    def _usage_from(meter: _StreamMeter, served: _Served) -> None:
        if meter.usage is not None:
            served.prompt_tokens = _count(meter.usage.get("prompt_tokens"))
            served.completion_tokens = _count(meter.usage.get("completion_tokens"))
        else:
            # No usage event was asked for: one SSE event carries one token in vLLM's streams.
            served.completion_tokens = meter.events

    def cut_streams(self, replica_id: str, why: str) -> int:
        """Close the upstream of every stream a replica is sending: each moves now, not at the idle timeout.

        Called when the router learns the replica is lost (its node unhealthy, recovery or the lifecycle
        took it out): waiting for a dead node's silence to time out would stall its clients for that long.
        """
        legs = self._live.pop(replica_id, set())
        for leg in legs:
            leg.cut = why
            # Wake the read now (closing alone may leave it waiting on a socket nobody will write to).
            leg.upstream.content.set_exception(aiohttp.ClientConnectionError(why))
            leg.upstream.close()
        return len(legs)

    # --- provenance ------------------------------------------------------------------------------------

    @staticmethod
    def _request_id(request: web.Request) -> str:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given and len(given) <= 128 and given.isprintable():  # noqa: PLR2004 - the event's limit
            return given
        return new_event_id()

    def _provenance(self, served: _Served) -> RequestServed:
        finished = served.finished or time.perf_counter()
        latency_s = finished - served.started
        ttft_s = None if served.first_byte is None else served.first_byte - served.started
        self._metrics.request_done(served.model, served.status, served.http_status, latency_s, ttft_s)
        replica = served.replica
        if replica is None and served.attempts:
            replica = self._registry.get(served.attempts[-1].replica)
        return RequestServed(
            source=self._source,
            jobid=None if replica is None else replica.replica_id,
            attempt=None if replica is None else replica.attempt,
            node=None if replica is None else replica.node,
            time=served.received_at,
            data=RequestServedData(
                request_id=served.request_id,
                model=served.model,
                version=served.version if replica is None else replica.version,
                replica=UNROUTED if replica is None else replica.replica_id,
                gpus=() if replica is None else replica.gpus,
                endpoint=None if replica is None else replica.endpoint,
                route=served.route,
                stream=served.stream,
                status=served.status,  # type: ignore[arg-type]
                http_status=served.http_status,
                error=served.error[:1000],
                attempts=tuple(served.attempts),
                continuations=served.continuations,
                received_at=served.received_at,
                ttft_ms=None if ttft_s is None else ttft_s * 1000,
                latency_ms=latency_s * 1000,
                prompt_tokens=served.prompt_tokens,
                completion_tokens=served.completion_tokens,
                router=self._router_name,
                tenant=served.tenant,
            ),
        )


def _last_failure(served: _Served) -> str:
    last = served.attempts[-1]
    return f"last try: {last.replica} {last.outcome}" + (f" ({last.detail})" if last.detail else "")


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and value >= 0 else None
