"""Reading streams back: ordered, read-only, leaving no durable consumer behind.

`iter_stream` is the one reader: an ephemeral ordered consumer with no acknowledgements, stored in memory on
the server and removed when the read ends (or, if this process dies, after it has been idle for a while).
`lanes replay`, `lanes timeline`, the demo and the projection rebuilds all read through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

_BUFFER_LIMIT = 10_000
_QUIET_S = 2.0
"""How long a read waits for a first or next message before deciding there is none."""


@dataclass(frozen=True)
class Selection:
    """Which part of which stream to read: a subject filter and optional sequence and time bounds."""

    stream: str
    subject: str
    from_seq: int | None = None
    to_seq: int | None = None
    since: datetime | None = None
    until: datetime | None = None

    def consumer_config(self) -> ConsumerConfig:
        """An ordered, unacknowledged, in-memory consumer positioned at the selection's start."""
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, deliver_policy=DeliverPolicy.ALL)
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

    An ordered push consumer (flow-controlled by the server, recreated by the client on a gap) fills a
    local buffer from its callback, and this generator drains the buffer in runs: no per-message task or
    round trip. The buffer is bounded; a full buffer pauses the callback, and so the delivery.
    """
    if await count(js, selection) == 0:
        return
    buffer: deque[Msg] = deque()
    arrived, drained = asyncio.Event(), asyncio.Event()

    async def on_message(msg: Msg) -> None:
        buffer.append(msg)
        arrived.set()
        if len(buffer) >= _BUFFER_LIMIT:
            drained.clear()
            await drained.wait()

    sub = await js.subscribe(
        selection.subject,
        stream=selection.stream,
        ordered_consumer=True,
        config=selection.consumer_config(),
        cb=on_message,
    )
    try:
        while True:
            if not buffer:
                arrived.clear()
                drained.set()
                try:
                    await asyncio.wait_for(arrived.wait(), timeout=_QUIET_S)
                except TimeoutError:  # nothing (more) at or after the start position
                    return
            while buffer:
                msg = buffer.popleft()
                meta = msg.metadata
                if selection.to_seq is not None and meta.sequence.stream > selection.to_seq:
                    return
                if selection.until is not None and meta.timestamp > selection.until:
                    return
                yield msg
                if meta.num_pending == 0:
                    return
            drained.set()
    finally:
        drained.set()
        # Ordered consumers are ephemeral but outlive an unsubscribe until they go idle: remove it now.
        with contextlib.suppress(Exception):
            name = (await sub.consumer_info()).name
            await asyncio.shield(js.delete_consumer(selection.stream, name))
        with contextlib.suppress(Exception):
            await asyncio.shield(sub.unsubscribe())
