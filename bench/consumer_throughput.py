"""Throughput of the consumer contract against raw nats-py fetch + ack on the same server, same run.

The contract does per event: decode, one PostgreSQL transaction (processed record + handler effects +
outbox), ack. The raw baseline only fetches and acks. Prints one JSON object per run.

    uv run python bench/consumer_throughput.py [--events 5000] [--runs 3]

Servers: NATS_URL / DATABASE_URL / REDIS_URL when set, embedded otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lanes_cli.stack import servers
from lanes_contract.client import publish_encoded
from lanes_contract.codec import encode
from lanes_contract.events import JobSubmitted, JobSubmittedData
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS
from lanes_runtime.consumer import ConsumerSpec, EventConsumer, Outcome, record_only
from lanes_runtime.log import configure_logging
from lanes_runtime.service import connected
from lanes_runtime.settings import ServerUrls, Settings


async def _publish(js: JetStreamContext, job_id: str, count: int) -> None:
    spec = JobSpec(name="bench", workers=1)
    encoded = [
        encode(JobSubmitted(source="bench", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
        for _ in range(count)
    ]
    for chunk in range(0, count, 500):
        await asyncio.gather(*(publish_encoded(js, e, stream="LANES_JOBS") for e in encoded[chunk : chunk + 500]))


async def one_run(urls: ServerUrls, events: int) -> dict[str, float]:
    """Publish `events` submissions, then time the raw consumer and the contract consumer over them."""
    async with connected(urls, name="bench") as conns:
        js = conns.nc.jetstream()
        job_id = f"bench-{uuid.uuid4().hex[:10]}"
        subject = f"lanes.job.{job_id}.submitted"
        await _publish(js, job_id, events)

        raw_config = ConsumerConfig(
            durable_name=f"raw-{job_id}",
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            filter_subject=subject,
            max_ack_pending=1024,
        )
        await js.add_consumer("LANES_JOBS", config=raw_config)
        raw = await js.pull_subscribe_bind(raw_config.durable_name, stream="LANES_JOBS")
        started, seen = time.perf_counter(), 0
        while seen < events:
            for msg in await raw.fetch(256, timeout=5):
                await msg.ack()
                seen += 1
        raw_rate = events / (time.perf_counter() - started)

        spec = ConsumerSpec(durable=f"contract-{job_id}", stream=JOBS, subjects=(subject,), batch=256)
        consumer = EventConsumer(conns.nc, conns.pool, spec, record_only)
        stop = asyncio.Event()
        started = time.perf_counter()
        task = asyncio.create_task(consumer.run(stop))
        while consumer.outcomes[Outcome.PROCESSED] < events:  # noqa: ASYNC110 - the consumer exposes counts only
            await asyncio.sleep(0.01)
        contract_rate = events / (time.perf_counter() - started)
        stop.set()
        await task
        return {"raw_msgs_per_s": round(raw_rate), "contract_msgs_per_s": round(contract_rate)}


def main() -> None:
    """Run the benchmark `--runs` times and print the medians and the ratio as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    configure_logging("warning")
    with servers(Settings.from_env()) as urls:
        runs = [asyncio.run(one_run(urls, args.events)) for _ in range(args.runs)]
    ratios = [r["contract_msgs_per_s"] / r["raw_msgs_per_s"] for r in runs]
    print(
        json.dumps(
            {
                "bench": "consumer_throughput",
                "events": args.events,
                "runs": runs,
                "median_raw_msgs_per_s": statistics.median(r["raw_msgs_per_s"] for r in runs),
                "median_contract_msgs_per_s": statistics.median(r["contract_msgs_per_s"] for r in runs),
                "median_ratio": round(statistics.median(ratios), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
