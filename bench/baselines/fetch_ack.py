"""The raw baselines of a consumer bench: fetch and ack the same messages, nothing else.

Two of them, each on a durable of its own over the same subjects, batches of 256:
- `nats_py_fetch_ack_per_s`: nats-py's `PullSubscription.fetch`, the client's own pull loop (the baseline
  the issue's ratios are stated against);
- `batch_pull_fetch_ack_per_s`: the runtime's `BatchPull`, which the services read with. It costs less CPU
  per message than nats-py's fetch, so a service ratio against it shows the service's own overhead alone.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lanes_runtime.delivery import BatchPull

BATCH = 256


async def fetch_ack_rates(nc: NatsClient, stream: str, subjects: list[str], total: int, tag: str) -> dict[str, float]:
    """Messages per second through each raw loop, over the `total` messages stored under `subjects`."""
    js = nc.jetstream()

    async def durable(name: str) -> str:
        config = ConsumerConfig(
            durable_name=f"raw-{name}-{tag}",
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            filter_subjects=subjects,
            max_ack_pending=4 * BATCH,
        )
        await js.add_consumer(stream, config=config)
        return config.durable_name or ""

    sub = await js.pull_subscribe_bind(await durable("nats-py"), stream=stream)
    nats_py = await _drain(lambda: sub.fetch(BATCH, timeout=5), total)
    await sub.unsubscribe()
    pull = await BatchPull.bind(nc, stream, await durable("batch-pull"))
    batch_pull = await _drain(lambda: pull.fetch(BATCH, 5), total)
    await pull.unsubscribe()
    return {"nats_py_fetch_ack_per_s": nats_py, "batch_pull_fetch_ack_per_s": batch_pull}


async def _drain(fetch: Callable[[], Awaitable[list[Msg]]], total: int) -> float:
    started, seen = time.perf_counter(), 0
    while seen < total:
        for msg in await fetch():
            await msg.ack()
            seen += 1
    return round(total / (time.perf_counter() - started))
