"""Replay speed: one job out of a large stream, and the whole stream, against a raw nats-py ordered consumer.

    uv run python bench/replay.py [--quick] [--events N] [--jobs J] [--runs R]

Publishes N events spread over J jobs into LANES_JOBS (binary-mode CloudEvents, as Lanes stores them),
then, R times: reads the whole stream with a raw ordered consumer (callback, no decoding, no output) and
with `lanes replay`'s reader + NDJSON writer (to /dev/null), and replays one job's timeline. The last line
of stdout is one JSON object with medians. Servers: NATS_URL when set, embedded otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig

from lanes_cli.replay import Pace, write_ndjson
from lanes_cli.stack import servers
from lanes_contract.client import connect_nats, publish_encoded
from lanes_contract.codec import encode
from lanes_contract.events import JobSubmitted, JobSubmittedData
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS, provision_streams
from lanes_runtime.log import configure_logging
from lanes_runtime.reader import Selection, iter_stream, reader_name
from lanes_runtime.settings import Settings


async def fill(nc: NatsClient, events: int, jobs: int, prefix: str) -> None:
    """Publish `events` submissions round-robin over `jobs` job ids, 1,000 in flight at a time."""
    js = nc.jetstream()
    spec = JobSpec(name="bench", workers=8, gpus_per_worker=8)
    template = [
        encode(JobSubmitted(source="bench", jobid=f"{prefix}-{j}", attempt=1, data=JobSubmittedData(spec=spec)))
        for j in range(jobs)
    ]
    for start in range(0, events, 1000):
        batch = []
        for i in range(start, min(start + 1000, events)):
            encoded = template[i % jobs]
            headers = encoded.headers | {"Nats-Msg-Id": f"{prefix}-{i}", "ce-id": f"{prefix}-{i}"}
            batch.append(
                publish_encoded(js, type(encoded)(encoded.subject, headers, encoded.payload), stream=JOBS.name)
            )
        await asyncio.gather(*batch)


async def raw_ordered(nc: NatsClient, expected: int) -> float:
    """Messages per second of a plain nats-py ordered consumer over the whole stream.

    Named in its create subject, as a reader's consumers must be under auth (`lanes_runtime.reader`); it never
    needs nats-py's recreate-after-a-gap here (nothing else reads meanwhile), which a name would break.
    """
    done = asyncio.Event()
    seen = 0

    async def on_message(msg: Msg) -> None:
        nonlocal seen
        seen += 1
        if msg.metadata.num_pending == 0:
            done.set()

    started = time.perf_counter()
    named = ConsumerConfig(name=reader_name())
    sub = await nc.jetstream().subscribe(">", stream=JOBS.name, ordered_consumer=True, cb=on_message, config=named)
    await done.wait()
    elapsed = time.perf_counter() - started
    await sub.unsubscribe()
    assert seen >= expected, (seen, expected)  # noqa: S101 - a bench that read less measured nothing
    return seen / elapsed


async def replay_rate(nc: NatsClient, selection: Selection, total: int) -> tuple[float, int]:
    """(seconds, events) for `lanes replay`'s reader and NDJSON writer over a selection."""
    with open(os.devnull, "wb") as sink:  # noqa: ASYNC230, PTH123 - writing to /dev/null does not block
        started = time.perf_counter()
        written = await write_ndjson(iter_stream(nc.jetstream(), selection), sink, Pace("instant"), total)
    return time.perf_counter() - started, written


async def run(nats_url: str, events: int, jobs: int, runs: int) -> dict[str, object]:
    """Fill the stream once, then measure `runs` times; return the medians and ratio."""
    nc = await connect_nats(nats_url, name="bench-replay")
    try:
        await provision_streams(nc.jetstream())
        prefix = f"b{time.time_ns() % 10**8}"
        started = time.perf_counter()
        await fill(nc, events, jobs, prefix)
        publish_rate = events / (time.perf_counter() - started)
        stored = (await nc.jetstream().stream_info(JOBS.name)).state.messages
        raw, whole, job_s = [], [], []
        for _ in range(runs):
            raw.append(await raw_ordered(nc, stored))
            seconds, written = await replay_rate(nc, Selection(JOBS.name, ">"), stored)
            whole.append(written / seconds)
            seconds, _ = await replay_rate(nc, Selection(JOBS.name, f"lanes.job.{prefix}-7.>"), events // jobs)
            job_s.append(seconds)
    finally:
        await nc.close()
    return {
        "bench": "replay",
        "events": stored,
        "jobs": jobs,
        "runs": runs,
        "publish_per_s": round(publish_rate),
        "raw_ordered_per_s": round(statistics.median(raw)),
        "replay_all_per_s": round(statistics.median(whole)),
        "replay_ratio": round(statistics.median(w / r for w, r in zip(whole, raw, strict=True)), 3),
        "replay_job_s": round(statistics.median(job_s), 4),
        "replay_job_events": events // jobs,
    }


def main() -> None:
    """Parse options, run against the configured or embedded NATS, print the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100,000 events (under a minute)")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    events = 100_000 if args.quick else args.events
    configure_logging("warning")
    settings = Settings.from_env()
    if settings.nats_url:
        result = asyncio.run(run(settings.nats_url, events, args.jobs, args.runs))
    else:
        with servers(settings) as urls:
            result = asyncio.run(run(urls.nats_url, events, args.jobs, args.runs))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
