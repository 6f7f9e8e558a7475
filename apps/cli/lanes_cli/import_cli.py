"""`lanes import FILE`: publish NDJSON structured CloudEvents (from `lanes replay` or an incident bundle).

Each line is decoded and validated like any event at the edge, then published with its own id, so
importing the same file twice stores each event once, and an incident bundle re-played into an empty
server gives the same timeline, finding and verdicts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from nats.js import JetStreamContext

from lanes_cli.console import EXIT_BAD_INPUT, fail, load_settings, out, require, run_async
from lanes_cli.limits import MAX_IMPORT_BYTES
from lanes_contract.client import connect_nats, publish_encoded
from lanes_contract.codec import decode_structured, encode
from lanes_contract.errors import DecodeError
from lanes_contract.events import Event
from lanes_contract.streams import STREAM_OF_FAMILY, provision_streams


def read_events(path: Path) -> list[Event]:
    """Every event of an NDJSON file, or a one-line error naming the first bad line.

    At most MAX_IMPORT_BYTES are read: a longer file (or a device that never ends) is refused before any
    event is decoded.
    """
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_IMPORT_BYTES + 1)
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}", EXIT_BAD_INPUT)
    if len(raw) > MAX_IMPORT_BYTES:
        fail(
            f"{path} is larger than the limit of {MAX_IMPORT_BYTES // (1024 * 1024)} MiB; import it in parts",
            EXIT_BAD_INPUT,
        )
    events = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if line.strip():
            try:
                events.append(decode_structured(line))
            except DecodeError as exc:
                fail(f"{path}:{number}: {exc}", EXIT_BAD_INPUT)
    return events


async def publish_all(js: JetStreamContext, events: list[Event]) -> tuple[int, int]:
    """Publish events in file order; return (newly stored, already present)."""
    await provision_streams(js)
    stored = duplicates = 0
    for event in events:
        published = await publish_encoded(js, encode(event), stream=STREAM_OF_FAMILY[event.family].name)
        duplicates += published.duplicate
        stored += not published.duplicate
    return stored, duplicates


def import_events(path: Annotated[Path, typer.Argument(help="NDJSON of structured CloudEvents.")]) -> None:
    """Publish the events of an NDJSON file; each event id is stored once, however often it is imported."""
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    events = read_events(path)

    async def run() -> tuple[int, int]:
        nc = await connect_nats(nats_url, name="lanes-import")
        try:
            return await publish_all(nc.jetstream(), events)
        finally:
            await nc.close()

    stored, duplicates = run_async(run)
    out.print_json(json.dumps({"stored": stored, "already_present": duplicates}))
