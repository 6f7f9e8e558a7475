"""`lanes incident <job>`: print the fault bundle of a job, or write it to a directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from lanes_common.bus import connect_nats
from lanes_common.codec import structured_line
from lanes_common.streams import JOBS
from lanes_ops.console import EXIT_NOT_FOUND, err, fail, load_settings, out, require, run_async
from lanes_ops.incident import bundle, write_bundle
from lanes_ops.replay import Selection, iter_stream
from lanes_ops.timeline import entry_of


async def gather(nats_url: str, job_id: str) -> tuple[dict[str, Any], list[bytes]]:
    """The job's timeline rows and the same events as NDJSON lines, from one read of the stream."""
    nc = await connect_nats(nats_url, name="lanes-incident")
    try:
        js = nc.jetstream()
        rows, lines = [], []
        async for msg in iter_stream(js, Selection(JOBS.name, f"lanes.job.{job_id}.>")):
            rows.append(entry_of(msg).as_json())
            lines.append(structured_line(msg.headers, msg.data, {"sequence": str(msg.metadata.sequence.stream)}))
    finally:
        await nc.close()
    return {"job_id": job_id, "timeline": rows}, lines


def incident(
    job_id: str,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Write incident.json, timeline.html, events.ndjson.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The fault bundle of a job: first error, evidence and missing evidence per lane, recovery, timings."""
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    job, lines = run_async(lambda: gather(nats_url, job_id))
    if not job["timeline"]:
        fail(f"unknown job {job_id!r}: no events on lanes.job.{job_id}.>", EXIT_NOT_FOUND)
    summary = bundle(job)
    if out_dir is not None:
        for path in write_bundle(job, lines, out_dir):
            err.print(f"wrote {path}")
    if as_json or out_dir is None:
        out.print_json(json.dumps(summary))
