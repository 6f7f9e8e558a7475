"""Reading streams back: in order, read-only, leaving no durable consumer behind.

`iter_stream` is the one reader of a stored range: a consumer of its own, named `read-<random>`, with no
acknowledgements, stored in memory on the server, pulled a batch at a time (`BatchPull`) and deleted when the
read ends (or, if this process dies, once it has been idle for READER_IDLE_S). `lanes replay`, `lanes
timeline`, the demo and the projection rebuilds all read through it. `follow` replays and then tails with the
same kind of consumer, made again from the first message not yielded when the server loses it: the router's
registry feed and the console follow the log live through it.

Why named, and pulled: the server takes the name of a consumer created without one in the subject
(`$JS.API.CONSUMER.CREATE.<stream>`) from the request's body, and a body naming a service's durable updates
that durable (its filter, say). A permission cannot look into a body. A reader therefore creates its
consumers with the name in the subject (`CREATE.<stream>.<name>[.<filter>]`, where the server refuses a body
that names another), and the identity table denies every reader each service's durable by name
(`lanes_contract.identities`). nats-py's ordered consumer creates without a name, and again under the same
config after a gap, so it cannot be used; a pull consumer without acknowledgements has no gaps to recover.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from enum import Enum

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from lanes_runtime.delivery import BatchPull, ConsumerGoneError

log = structlog.get_logger(__name__)
READER_PREFIX = "read-"
"""The names of readers' consumers start with it; no durable's name does (the identity table checks)."""
READER_IDLE_S = 30.0
"""How long the server keeps a reader's consumer that nobody pulls from (its reader died)."""
_BATCH = 256
_QUIET_S = 2.0
"""How long a read waits for a first or next message before deciding there is none."""
_FOLLOW_WAIT_S = 1.0
"""How long one pull of a follower waits for a new event before it asks again (a new event ends the wait)."""
_FOLLOW_RETRY_S = 1.0


def reader_name() -> str:
    """A fresh consumer name for one read (random: no one else can guess it to ask about it)."""
    return f"{READER_PREFIX}{uuid.uuid4().hex}"


def reader_config(name: str, subjects: list[str], start: DeliverPolicy = DeliverPolicy.ALL) -> ConsumerConfig:
    """An unacknowledged, in-memory pull consumer named in its create subject, gone once idle."""
    config = ConsumerConfig(
        name=name,
        ack_policy=AckPolicy.NONE,
        deliver_policy=start,
        mem_storage=True,
        num_replicas=1,
        inactive_threshold=READER_IDLE_S,
    )
    if len(subjects) == 1:
        config.filter_subject = subjects[0]  # nats-py puts a single filter in the create subject
    else:
        config.filter_subjects = subjects
    return config


@dataclass(frozen=True)
class Selection:
    """Which part of which stream to read: a subject filter and optional sequence and time bounds."""

    stream: str
    subject: str
    from_seq: int | None = None
    to_seq: int | None = None
    since: datetime | None = None
    until: datetime | None = None

    def consumer_config(self, name: str) -> ConsumerConfig:
        """A reader's consumer positioned at the selection's start."""
        config = reader_config(name, [self.subject])
        if self.from_seq is not None:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, self.from_seq
        elif self.since is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = self.since
        return config


async def count(js: JetStreamContext, selection: Selection) -> int:
    """How many stored messages match the selection's subject (ignoring its bounds); 0 if no stream."""
    try:
        info = await js.stream_info(selection.stream, subjects_filter=selection.subject)
    except NotFoundError:
        return 0
    return sum((info.state.subjects or {}).values())


async def iter_stream(js: JetStreamContext, selection: Selection) -> AsyncIterator[Msg]:
    """Yield the selected messages in stream order, then stop; read-only.

    Each pull brings a batch in one request; the read ends at the selection's bounds, at the last message
    stored when it was delivered (`num_pending` 0), or after _QUIET_S without one.
    """
    if await count(js, selection) == 0:
        return
    reading = _Reading(js, selection)
    try:
        while True:
            msgs = await reading.fetch()
            if not msgs:
                return  # nothing (more) at or after the start position
            for msg in msgs:
                meta = msg.metadata
                if selection.to_seq is not None and meta.sequence.stream > selection.to_seq:
                    return
                if selection.until is not None and meta.timestamp > selection.until:
                    return
                yield msg
                if meta.num_pending == 0:
                    return
    finally:
        await asyncio.shield(reading.close())


class _Reading:
    """One read's consumer, made again from where the read is when it lapsed.

    A reader's consumer goes once nobody has pulled from it for READER_IDLE_S, and a read may rightly wait
    longer between two pulls: `lanes replay --pace original` sleeps for the events' own spacing, and a merge
    of several selections leaves one waiting while it takes the others.
    """

    def __init__(self, js: JetStreamContext, selection: Selection) -> None:
        self._js = js
        self._selection = selection
        self._name: str | None = None
        self._pull: BatchPull | None = None
        self._next_seq: int | None = None
        """The first sequence not delivered yet (None: nothing delivered, from the selection's start)."""

    async def fetch(self) -> list[Msg]:
        """The next batch (empty: nothing more within _QUIET_S)."""
        if self._pull is None:
            self._pull = await self._open()
        try:
            msgs = await self._pull.fetch(_BATCH, _QUIET_S)
        except ConsumerGoneError:
            await self.close()
            self._pull = await self._open()
            msgs = await self._pull.fetch(_BATCH, _QUIET_S)
        if msgs:
            self._next_seq = msgs[-1].metadata.sequence.stream + 1  # delivered without acks: the read is past it
        return msgs

    async def _open(self) -> BatchPull:
        self._name = reader_name()
        config = self._selection.consumer_config(self._name)
        if self._next_seq is not None:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, self._next_seq
            config.opt_start_time = None
        await self._js.add_consumer(self._selection.stream, config=config)
        nc: NatsClient = self._js._nc  # noqa: SLF001 - the connection the context makes its requests on
        return await BatchPull.bind(nc, self._selection.stream, self._name)

    async def close(self) -> None:
        """Stop pulling and delete the consumer (one that lapsed is gone already)."""
        pull, self._pull = self._pull, None
        if pull is not None:
            with contextlib.suppress(Exception):
                await pull.unsubscribe()
        if self._name is not None:
            with contextlib.suppress(Exception):
                await self._js.delete_consumer(self._selection.stream, self._name)


class Mark(Enum):
    """What `follow` yields besides messages."""

    CAUGHT_UP = "caught_up"
    """Once, after the last message that was stored when the read began (at once if there was none)."""
    IDLE = "idle"
    """After a pull that found nothing new: the reader may say it is still there (an SSE comment)."""


async def follow(
    nc: NatsClient, stream: str, subjects: tuple[str, ...], from_seq: int | None = None
) -> AsyncGenerator[Msg | Mark, None]:
    """Yield the stream's messages on `subjects` in order, from `from_seq` (default: the start), forever.

    Yields Mark.CAUGHT_UP once, after the last message stored when the read began, and Mark.IDLE after each
    pull that found nothing. Close it (`contextlib.aclosing`) to delete its consumer at once.
    """
    js = nc.jetstream()
    next_seq = from_seq
    said_caught_up = False
    while True:
        name = reader_name()
        config = reader_config(name, list(subjects))
        if next_seq is not None:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, next_seq
        pull: BatchPull | None = None
        try:
            await js.add_consumer(stream, config=config)
            pull = await BatchPull.bind(nc, stream, name)
            while True:
                msgs = await pull.fetch(_BATCH, _FOLLOW_WAIT_S)
                for msg in msgs:
                    next_seq = msg.metadata.sequence.stream + 1
                    yield msg
                if not said_caught_up and (not msgs or msgs[-1].metadata.num_pending == 0):
                    said_caught_up = True
                    yield Mark.CAUGHT_UP
                elif not msgs:
                    yield Mark.IDLE
        except (NatsError, OSError, TimeoutError) as exc:
            # The stream is not there yet, the server restarted (a reader's consumer lives in its memory) or
            # is away: make the consumer again, from the first message not yielded, once it answers.
            log.warning("stream follower interrupted; following again", stream=stream, error=str(exc) or repr(exc))
            await asyncio.sleep(_FOLLOW_RETRY_S)
        finally:
            if pull is not None:
                with contextlib.suppress(Exception):
                    await pull.unsubscribe()
            with contextlib.suppress(Exception):
                await asyncio.shield(js.delete_consumer(stream, name))
