"""Live console latency: from publish to the event's row on the console's SSE feed, during a 1,024-rank storm.

    uv run python bench/console.py [--ranks N] [--runs R]

On an embedded NATS (auth on), the console is served as its `console` identity and one SSE client follows a
job's feed (`/api/jobs/<id>/events`), caught up. Then, R times, N ranks of a fresh job exit at once (N
`rank_exited` events published together, as a storm lands): the latency of each event is the time from the
start of its publish to its row arriving on the feed. Beside it, the raw baseline: a plain core-NATS
subscriber on the same subjects, which is as soon as any reader can know. The anchor the issue names, a page
that polls every 10 s, is not run: its wait is uniform over the 10 s (p50 5 s, p99 9.9 s) on top of the
read. The console server, the SSE client and the raw subscriber share this process and its event loop.
The last line of stdout is one JSON object with the medians over the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp
from nats.aio.msg import Msg

from lanes_console.app import serve
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.events import JobSubmitted, JobSubmittedData, RankExited, RankExitedData
from lanes_contract.jobs import JobSpec
from lanes_runtime.log import configure_logging
from lanes_sandbox.embedded import EmbeddedNats

POLL_S = 10.0


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sse_rows(
    response: aiohttp.ClientResponse, arrived: dict[int, float], wanted: int, done: asyncio.Event
) -> None:
    """Note when each rank's row arrives on the feed."""
    event = ""
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: ") and event == "row":
            row = json.loads(line.removeprefix("data: "))
            if row.get("kind") == "rank_exited":
                arrived.setdefault(int(row["rank"]), time.perf_counter())
                if len(arrived) >= wanted:
                    done.set()


async def one_run(url: str, nats: EmbeddedNats, publisher: LanesClient, ranks: int, run: int) -> dict[str, float]:
    """One storm on a fresh job: each exit's latency to the console's feed and to a raw subscriber."""
    job = f"storm-{run}-{time.time_ns()}"
    await publisher.publish(
        JobSubmitted(source="bench", jobid=job, attempt=1, data=JobSubmittedData(spec=JobSpec(name="storm", workers=1)))
    )
    raw_nc = await connect_nats(nats.url_for("console"), name="bench-raw")
    raw_arrived: dict[int, float] = {}

    async def on_raw(msg: Msg) -> None:
        if msg.subject.endswith(".rank_exited"):
            raw_arrived.setdefault(int(msg.headers["ce-rank"]) if msg.headers else -1, time.perf_counter())

    await raw_nc.subscribe(f"lanes.job.{job}.>", cb=on_raw)
    arrived: dict[int, float] = {}
    done = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        response = await session.get(f"{url}api/jobs/{job}/events", timeout=aiohttp.ClientTimeout(total=None))
        caught_up = asyncio.Event()

        async def until_caught_up() -> None:
            async for raw in response.content:
                if raw.startswith(b"event: caught_up"):
                    caught_up.set()
                    return

        await until_caught_up()
        reading = asyncio.create_task(sse_rows(response, arrived, ranks, done))
        sent: dict[int, float] = {}

        async def exit_rank(rank: int) -> None:
            sent[rank] = time.perf_counter()
            await publisher.publish(
                RankExited(
                    source="bench",
                    jobid=job,
                    attempt=1,
                    node=f"node-{rank // 8}",
                    rank=rank,
                    data=RankExitedData(exit_code=None, signal=9),
                )
            )

        started = time.perf_counter()
        await asyncio.gather(*(exit_rank(rank) for rank in range(ranks)))
        published_s = time.perf_counter() - started
        await asyncio.wait_for(done.wait(), 120)
        reading.cancel()
    await raw_nc.close()
    console = [arrived[rank] - sent[rank] for rank in range(ranks)]
    raw = [raw_arrived[rank] - sent[rank] for rank in range(ranks) if rank in raw_arrived]
    return {
        "console_p50_ms": quantile(console, 0.5) * 1000,
        "console_p99_ms": quantile(console, 0.99) * 1000,
        "raw_p50_ms": quantile(raw, 0.5) * 1000,
        "raw_p99_ms": quantile(raw, 0.99) * 1000,
        "storm_published_s": published_s,
    }


async def main(ranks: int, runs: int) -> dict[str, object]:
    """Serve the console on an embedded NATS and measure `runs` storms of `ranks` exits."""
    with EmbeddedNats() as nats:
        reader = await connect_nats(nats.url_for("console"), name="bench-console")
        publisher = await LanesClient.connect(
            nats.url_for("platform"), source="bench", signer=nats.signer_for("platform")
        )
        runner, url = await serve(reader, "127.0.0.1", 0)
        try:
            results = [await one_run(url, nats, publisher, ranks, run) for run in range(runs)]
        finally:
            await runner.cleanup()
            await publisher.close()
            await reader.close()
    medians = {key: round(statistics.median(r[key] for r in results), 2) for key in results[0]}
    return {
        "bench": "console",
        "ranks": ranks,
        "runs": runs,
        **medians,
        "ratio_p50_console_to_raw": round(medians["console_p50_ms"] / max(medians["raw_p50_ms"], 1e-3), 2),
        "anchor_10s_poll_p50_ms": POLL_S / 2 * 1000,
        "anchor_10s_poll_p99_ms": POLL_S * 0.99 * 1000,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    configure_logging("warning")
    print(json.dumps(asyncio.run(main(args.ranks, args.runs))))
