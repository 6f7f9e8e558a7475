"""The outbox: events go to a local NDJSON file first, then to JetStream, so Lanes being down loses nothing.

A producer that observes someone else's job (`lanes run`, the Slurm adapter) must never block or fail
that job because Lanes is unreachable. It appends each event to the outbox file (structured CloudEvents,
one per line: the format `lanes replay` writes and `lanes import` reads) and a `Sender` publishes the file
whenever NATS answers. Published lines are cut from the file, so the file always holds exactly what has
not been sent: `lanes import FILE` publishes the rest, and every event keeps its id, so a line published
twice inside the stream's duplicate window is stored once.

An event whose id the stream already holds for another event (`EventIdConflictError`) can never be stored:
retrying it would hold back every event after it for good. It is set aside in a second file beside the
outbox (`<name>.conflicts.ndjson`, same format) and logged as an error, and the rest go on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import structlog
from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError

from lanes_contract.client import connect_nats, publish_encoded
from lanes_contract.codec import decode_structured, encode, to_structured
from lanes_contract.errors import EventIdConflictError, LanesError
from lanes_contract.events import Event
from lanes_contract.streams import STREAM_OF_FAMILY, provision_streams

log = structlog.get_logger(__name__)


class Outbox:
    """An append-only NDJSON file of events not yet published."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conflicts_path = path.with_name(f"{path.stem}.conflicts{path.suffix or '.ndjson'}")

    def append(self, events: Sequence[Event]) -> None:
        """Write events at the end of the file (created with its directory when missing)."""
        if not events:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = b"".join(
            json.dumps(to_structured(event), separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
            for event in events
        )
        # Written through to the OS at once: the file survives the producer's crash. Not fsync'ed per line:
        # a synced write per evidence line would cost the job milliseconds each (bench/run_wrapper.py).
        with self.path.open("ab") as handle:
            handle.write(lines)

    def size(self) -> int:
        """The file's length in bytes (0 when it does not exist): a mark `take_back` returns to."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def take_back(self, mark: int) -> None:
        """Cut what was appended since `size()` returned `mark` (never sent: no sender ran in between)."""
        if mark == 0:
            self.path.unlink(missing_ok=True)
            return
        with self.path.open("r+b") as handle:
            handle.truncate(mark)

    def lines(self) -> list[bytes]:
        """The events waiting, as stored lines (none when the file does not exist)."""
        try:
            return [line for line in self.path.read_bytes().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def set_aside(self, line: bytes) -> None:
        """Keep a line that can never be published (its id is taken) in the conflicts file, not in the outbox."""
        with self.conflicts_path.open("ab") as handle:
            handle.write(line + b"\n")

    def drop_first(self, count: int) -> None:
        """Cut the first `count` lines (published); remove the file once nothing is left.

        Only ever called between awaits, so no append interleaves: appends only add lines after these.
        """
        rest = self.lines()[count:]
        if not rest:
            self.path.unlink(missing_ok=True)
            return
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_bytes(b"".join(line + b"\n" for line in rest))
        partial.replace(self.path)


class Sender:
    """Publishes an outbox whenever NATS answers; never raises because Lanes is unreachable."""

    def __init__(self, outbox: Outbox, nats_url: str | None, *, name: str, connect_timeout_s: float = 2.0) -> None:
        self.outbox = outbox
        self._url = nats_url
        self._name = name
        self._timeout = connect_timeout_s
        self._nc: NatsClient | None = None
        self.last_error: str | None = None if nats_url else "NATS_URL is not set"
        self.set_aside = 0
        """Events set aside so far because their id was taken (in `outbox.conflicts_path`)."""

    async def send(self) -> bool:
        """Publish every waiting event in file order; return whether the outbox is now empty."""
        if self._url is None:
            return not self.outbox.lines()
        sent = 0
        try:
            if self._nc is None:
                self._nc = await connect_nats(self._url, name=self._name, connect_timeout_s=self._timeout)
                await provision_streams(self._nc.jetstream())
            js = self._nc.jetstream()
            for line in self.outbox.lines():
                event = decode_structured(line)
                try:
                    await publish_encoded(js, encode(event), stream=STREAM_OF_FAMILY[event.family].name)
                except EventIdConflictError as exc:
                    self.outbox.set_aside(line)
                    self.set_aside += 1
                    log.error(  # noqa: TRY400 - the conflict's message says it all; no traceback to add
                        "event set aside: its id is taken",
                        event_id=event.id,
                        kept_in=str(self.outbox.conflicts_path),
                        error=str(exc),
                    )
                sent += 1
        except (LanesError, NatsError, OSError, TimeoutError) as exc:
            self.last_error = str(exc) or type(exc).__name__
            log.warning(
                "lanes unreachable; events stay in the outbox", path=str(self.outbox.path), error=self.last_error
            )
            await self.close()
            return False
        finally:
            self.outbox.drop_first(sent)
        self.last_error = None
        return True

    async def close(self) -> None:
        """Drop the connection (a later `send` connects again)."""
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            try:
                await nc.close()
            except (NatsError, OSError, TimeoutError) as exc:  # closing a dead connection: nothing to keep
                log.debug("closing the nats connection failed", error=str(exc))
