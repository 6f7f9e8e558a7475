"""Reading streams back: ordered, read-only, resumable, leaving no durable consumer behind.

`iter_stream` is the one reader: an ephemeral pull consumer with no acknowledgements, stored in memory on
the server and removed when the read ends (or, if this process dies, after it has been idle for a while).
`lanes replay`, `lanes timeline` and the demo all read through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import BinaryIO

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from lanes_common.codec import decode, structured_line, to_structured
from lanes_common.errors import DecodeError
from lanes_common.ids import validate_token
from lanes_common.streams import JOBS, NODES, TELEMETRY

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


def selections(*, job: str | None, node: str | None, subject: str | None, stream: str | None) -> list[Selection]:
    """Turn the replay options into stream selections (a node's events live in two streams)."""
    chosen = [name for name, value in (("--job", job), ("--node", node), ("--subject", subject)) if value]
    if len(chosen) > 1:
        msg = f"choose one of --job, --node, --subject (got {', '.join(chosen)})"
        raise ValueError(msg)
    if job:
        return [Selection(JOBS.name, f"lanes.job.{validate_token(job)}.>")]
    if node:
        token = validate_token(node)
        return [Selection(NODES.name, f"lanes.node.{token}.>"), Selection(TELEMETRY.name, f"lanes.tel.{token}.>")]
    if subject:
        if not re.fullmatch(r"[A-Za-z0-9_\-*>]+(\.[A-Za-z0-9_\-*>]+)*", subject):
            msg = f"{subject!r} is not a subject filter"
            raise ValueError(msg)
        return [Selection(stream or _stream_of(subject), subject)]
    return [Selection(stream or JOBS.name, ">")]


def _stream_of(subject: str) -> str:
    for prefix, spec in (("lanes.job.", JOBS), ("lanes.node.", NODES), ("lanes.tel.", TELEMETRY)):
        if subject.startswith(prefix):
            return spec.name
    msg = f"say which stream holds {subject!r} with --stream"
    raise ValueError(msg)


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


class Pace:
    """How fast to replay: as fast as possible, at the original spacing of the events, or N times faster."""

    def __init__(self, spec: str) -> None:
        if spec == "instant":
            self.speed: float | None = None
        elif spec == "original":
            self.speed = 1.0
        elif (match := re.fullmatch(r"x(\d+(?:\.\d+)?)", spec)) and float(match.group(1)) > 0:
            self.speed = float(match.group(1))
        else:
            msg = f"--pace must be instant, original or xN (e.g. x10), not {spec!r}"
            raise ValueError(msg)
        self._previous: datetime | None = None

    async def wait_for(self, stored_at: datetime) -> None:
        """Sleep for the gap since the previous event, scaled by the speed."""
        if self.speed is not None and self._previous is not None:
            gap = (stored_at - self._previous).total_seconds() / self.speed
            if gap > 0:
                await asyncio.sleep(gap)
        self._previous = stored_at


async def merged(js: JetStreamContext, chosen: list[Selection]) -> AsyncIterator[Msg]:
    """The messages of several selections merged by the time they were stored (one selection: as is)."""
    readers = [aiter(iter_stream(js, selection)) for selection in chosen]
    heads = {i: msg for i, reader in enumerate(readers) if (msg := await anext(reader, None)) is not None}
    while heads:
        index = min(heads, key=lambda i: heads[i].metadata.timestamp)
        yield heads[index]
        following = await anext(readers[index], None)
        if following is None:
            del heads[index]
        else:
            heads[index] = following


async def write_ndjson(
    messages: AsyncIterator[Msg], out: BinaryIO, pace: Pace, total: int, *, validate: bool = False
) -> int:
    """Write each message as one structured CloudEvent per line; show progress on stderr; return the count.

    Without `validate` the line is built from the stored headers and payload as they are (fast); with it,
    every event is decoded and an invalid one becomes an `{"sequence", "subject", "error"}` line. Either
    way no message is skipped.
    """
    written = 0
    columns = (
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>8.0f} events/s"),
        TimeRemainingColumn(),
    )
    console = Console(stderr=True)
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("replay", total=total or None, rate=0.0)
        started = time.perf_counter()
        async for msg in messages:
            meta = msg.metadata
            if pace.speed is not None:
                await pace.wait_for(meta.timestamp)
            out.write(_line(msg, validate=validate) + b"\n")
            written += 1
            if written % 1000 == 0:
                out.flush()
                rate = written / max(time.perf_counter() - started, 1e-9)
                progress.update(task, completed=written, rate=rate)
        out.flush()
    return written


def _line(msg: Msg, *, validate: bool) -> bytes:
    seq = msg.metadata.sequence.stream
    try:
        if validate:
            event = to_structured(decode(msg.subject, msg.headers, msg.data))
            return json.dumps({**event, "sequence": str(seq)}, separators=(",", ":"), ensure_ascii=False).encode()
        return structured_line(msg.headers, msg.data, {"sequence": str(seq)})
    except (DecodeError, ValueError) as exc:
        problem = {"sequence": str(seq), "subject": msg.subject, "error": str(exc)}
        return json.dumps(problem, separators=(",", ":"), ensure_ascii=False).encode()
