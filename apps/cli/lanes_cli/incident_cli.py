"""`lanes incident <job>`: print the fault bundle of a job, or write it to a directory."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from lanes_cli.console import (
    EXIT_NOT_FOUND,
    cannot_write,
    checked_job_id,
    err,
    fail,
    load_settings,
    out,
    output_dir,
    require,
    run_async,
    signers_keyring,
)
from lanes_cli.incident import bundle, serves, write_bundle
from lanes_cli.terminal import print_json
from lanes_cli.timeline import entry_of
from lanes_contract.client import connect_nats
from lanes_contract.codec import structured_line
from lanes_contract.signing import Keyring
from lanes_contract.streams import JOBS, REQUESTS
from lanes_runtime.reader import Selection, iter_stream


async def gather(
    nats_url: str, job_id: str, keyring: Keyring | None = None
) -> tuple[dict[str, Any], list[bytes], list[dict[str, Any]]]:
    """The job's timeline rows, the inference requests of its time window (a replica's), and both as NDJSON."""
    nc = await connect_nats(nats_url, name="lanes-incident")
    try:
        js = nc.jetstream()
        rows: list[dict[str, Any]] = []
        requests: list[dict[str, Any]] = []
        lines: list[bytes] = []

        async def read(selection: Selection, into: list[dict[str, Any]]) -> None:
            async for msg in iter_stream(js, selection):
                into.append(entry_of(msg, keyring).as_json())
                lines.append(structured_line(msg.headers, msg.data, {"sequence": str(msg.metadata.sequence.stream)}))

        await read(Selection(JOBS.name, f"lanes.job.{job_id}.>"), rows)
        if rows and serves(rows):
            # A request that failed over is stored under the replica that finally served it, so the whole
            # request stream of the job's lifetime is read and filtered by the replicas each request tried.
            since = datetime.fromisoformat(str(rows[0]["time"]))
            await read(Selection(REQUESTS.name, "lanes.req.>", since=since), requests)
    finally:
        await nc.close()
    return {"job_id": job_id, "timeline": rows}, lines, requests


def incident(
    job_id: str,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Write incident.json, timeline.html, events.ndjson.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The fault bundle of a job: first error, evidence per lane, decision chain, timings, requests touched."""
    checked_job_id(job_id)
    if out_dir is not None:
        output_dir(out_dir, "--out")
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    keyring = signers_keyring(settings)
    job, lines, requests = run_async(lambda: gather(nats_url, job_id, keyring))
    if not job["timeline"]:
        fail(f"unknown job {job_id!r}: no events on lanes.job.{job_id}.>", EXIT_NOT_FOUND)
    summary = bundle(job, requests)
    if out_dir is not None:
        try:
            written = write_bundle(job, lines, out_dir, requests)
        except OSError as exc:
            cannot_write(out_dir, exc)
        for path in written:
            err.print(f"wrote {path}")
    if as_json or out_dir is None:
        print_json(out, summary)
