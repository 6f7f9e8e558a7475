"""What faststream's subscriber layer costs over the consumer runtime's own loop (issue 13's adoption test).

The same stored events are consumed three ways, each by a fresh durable on the same servers in one run:
- `raw_fetch_ack_per_s`: nats-py alone, fetch and ack;
- `own_loop_per_s`: `EventConsumer.run`, the runtime's fetch loop, around its batch processor;
- `faststream_per_s`: faststream's batch pull subscriber (manual acks) handing each fetched batch to the
  same batch processor (`EventConsumer.process_batch`: one transaction, outbox, each message's decision).

The handler only records the events as processed (`record_only`), so the figures compare the layers, not a
service. `layer_cost` = 1 - faststream / own loop: above 0.10 the runtime keeps its own loop (and generates
its AsyncAPI documents from the event catalogue itself, `lanes asyncapi`).

    uv run python bench/faststream_layer.py [--events 5000] [--runs 3]

Prints one JSON object (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
import uuid

from faststream import Context
from faststream.middlewares import AckPolicy
from faststream.nats import JStream, NatsBroker, PullSub
from faststream.nats.message import NatsBatchMessage
from nats.js.api import AckPolicy as JsAckPolicy
from nats.js.api import ConsumerConfig, DeliverPolicy

from lanes_cli.stack import servers
from lanes_contract.client import publish_encoded
from lanes_contract.codec import encode
from lanes_contract.events import EvidenceCategory, EvidenceData, HostEvidence
from lanes_contract.streams import TELEMETRY
from lanes_runtime.consumer import ConsumerSpec, EventConsumer, Outcome, record_only
from lanes_runtime.log import configure_logging
from lanes_runtime.service import Connections, connected
from lanes_runtime.settings import ServerUrls, Settings

BATCH = 256


async def _until_processed(consumer: EventConsumer, events: int) -> None:
    while consumer.outcomes[Outcome.PROCESSED] < events:  # noqa: ASYNC110 - the consumer exposes counts only
        await asyncio.sleep(0.01)


def _spec(durable: str, subject: str) -> ConsumerSpec:
    return ConsumerSpec(durable=durable, stream=TELEMETRY, subjects=(subject,), batch=BATCH)


async def _raw(conns: Connections, subject: str, events: int, tag: str) -> float:
    js = conns.nc.jetstream()
    config = ConsumerConfig(
        durable_name=f"raw-{tag}",
        filter_subject=subject,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=JsAckPolicy.EXPLICIT,
        max_ack_pending=1024,
    )
    await js.add_consumer(TELEMETRY.name, config=config)
    sub = await js.pull_subscribe_bind(f"raw-{tag}", stream=TELEMETRY.name)
    began, seen = time.perf_counter(), 0
    while seen < events:
        for msg in await sub.fetch(BATCH, timeout=5):
            await msg.ack()
            seen += 1
    return events / (time.perf_counter() - began)


async def _own_loop(conns: Connections, subject: str, events: int, tag: str) -> float:
    consumer = EventConsumer(conns.nc, conns.pool, _spec(f"own-{tag}", subject), record_only)
    await consumer.provision()
    stop = asyncio.Event()
    began = time.perf_counter()
    task = asyncio.create_task(consumer.run(stop))
    await _until_processed(consumer, events)
    rate = events / (time.perf_counter() - began)
    stop.set()
    await task
    return rate


async def _undecoded(message: object) -> None:
    """Decode nothing: the default JSON-decodes every body, which the processor then does again."""
    del message


async def _faststream(conns: Connections, urls: ServerUrls, subject: str, events: int, tag: str) -> float:
    spec = _spec(f"fs-{tag}", subject)
    consumer = EventConsumer(conns.nc, conns.pool, spec, record_only)
    await consumer.provision()  # the same durable configuration; faststream binds to it
    broker = NatsBroker(urls.nats_url, logger=None)  # the own loop logs nothing per batch either

    @broker.subscriber(
        subject,
        stream=JStream(TELEMETRY.name, declare=False),
        durable=spec.durable,
        pull_sub=PullSub(batch_size=BATCH, timeout=0.5, batch=True),
        ack_policy=AckPolicy.MANUAL,
        decoder=_undecoded,
    )
    async def handle(body: object, message: NatsBatchMessage = Context("message")) -> None:  # noqa: B008
        del body  # the processor decodes the raw messages itself, with the envelope's headers
        await consumer.process_batch(message.raw_message)

    await broker.start()  # its own connection: not timed (the own loop's connection is not timed either)
    began, before = time.perf_counter(), consumer.outcomes[Outcome.PROCESSED]
    try:
        await _until_processed(consumer, events)
        rate = (events - before) / (time.perf_counter() - began)
    finally:
        await broker.stop()
    del handle
    return rate


async def one_run(urls: ServerUrls, events: int) -> dict[str, float]:
    """Publish `events` once, then consume them the three ways."""
    tag = uuid.uuid4().hex[:6]
    node = f"fs-{tag}"
    subject = f"lanes.tel.{node}.>"
    async with connected(urls, name="bench-faststream") as conns:
        js = conns.nc.jetstream()
        encoded = [
            encode(
                HostEvidence(
                    source="bench",
                    node=node,
                    data=EvidenceData(category=EvidenceCategory.RAW, lines=(f"line {i}",)),
                )
            )
            for i in range(events)
        ]
        for chunk in range(0, events, 500):
            await asyncio.gather(*(publish_encoded(js, e) for e in encoded[chunk : chunk + 500]))
        raw = await _raw(conns, subject, events, tag)
        own = await _own_loop(conns, subject, events, tag)
        fast = await _faststream(conns, urls, subject, events, tag)
        for durable in (f"raw-{tag}", f"own-{tag}", f"fs-{tag}"):
            with contextlib.suppress(Exception):
                await js.delete_consumer(TELEMETRY.name, durable)
    return {
        "raw_fetch_ack_per_s": raw,
        "own_loop_per_s": own,
        "faststream_per_s": fast,
        "own_loop_ratio": own / raw,
        "faststream_ratio": fast / raw,
        "layer_cost": 1 - fast / own,
    }


def main() -> None:
    """Run `--runs` times on fresh servers and print the medians as one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    configure_logging("warning")
    runs = []
    for _ in range(args.runs):
        with servers(Settings.from_env()) as urls:
            runs.append(asyncio.run(one_run(urls, args.events)))
    medians = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
    print(json.dumps({"bench": "faststream_layer", "events": args.events, "runs": len(runs), "medians": medians}))


if __name__ == "__main__":
    main()
