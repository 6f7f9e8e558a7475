"""`lanes replay`: which streams to read for a job, node or subject, at what pace, written as NDJSON.

The reading itself is `lanes_runtime.reader.iter_stream`, shared with the timeline, the demo and the rebuilds.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import BinaryIO

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from lanes_contract.codec import decode, structured_line, to_structured
from lanes_contract.errors import DecodeError
from lanes_contract.ids import is_valid_token, validate_token
from lanes_contract.streams import JOBS, NODES, TELEMETRY
from lanes_runtime.reader import Selection, iter_stream


def selections(*, job: str | None, node: str | None, subject: str | None, stream: str | None) -> list[Selection]:
    """Turn the replay options into stream selections (a node's events live in two streams)."""
    chosen = [name for name, value in (("--job", job), ("--node", node), ("--subject", subject)) if value]
    if len(chosen) > 1:
        msg = f"choose one of --job, --node, --subject (got {', '.join(chosen)})"
        raise ValueError(msg)
    if stream is not None and not is_valid_token(stream):
        msg = f"--stream {stream!r} is not a stream name: 1-128 characters from A-Z a-z 0-9 _ -"
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
