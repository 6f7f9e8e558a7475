"""Live console latency during a 1,024-rank storm, and a 100,000-event job's first paint and memory in Chromium.

    uv run python bench/console.py [--ranks N] [--runs R] [--paint-events E] [--paint-runs P]

On an embedded NATS (auth on), the console is served as its `console` identity and one SSE client follows a
job's feed (`/api/jobs/<id>/events`), caught up. Then, R times, N ranks of a fresh job exit at once (N
`rank_exited` events published together, as a storm lands): the latency of each event is the time from the
start of its publish to its row arriving on the feed. Beside it, the raw baseline: a plain core-NATS
subscriber on the same subjects, which is as soon as any reader can know. The anchor the issue names, a page
that polls every 10 s, is not run: its wait is uniform over the 10 s (p50 5 s, p99 9.9 s) on top of the
read. The console server, the SSE client and the raw subscriber share this process and its event loop.

First paint (with Chromium on PATH; `--paint-events 0` skips it): one job of E events (a submitted, a finding
naming rank 7's OOM, N ranks timing out after it, then heartbeats up to E) is stored, and Debian's Chromium,
headless through Playwright, opens its job page P times, each in a fresh profile: the time from navigation to
the page drawn from the feed's catch-up (`body[data-caught-up]`: the newest rows, the first error, the storm
as one group), the rows in the DOM, and the JS heap and DOM node count the browser reports then. Beside it, the
raw baseline: one reader's consumer reading the job's E stored events from JetStream and doing nothing with
them, the least any page of all of them could cost.
The last line of stdout is one JSON object with the medians over the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time

import aiohttp
from nats.aio.msg import Msg

from lanes_console.app import serve
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.events import (
    FindingCause,
    Heartbeat,
    HeartbeatData,
    JobFinding,
    JobFindingData,
    JobSubmitted,
    JobSubmittedData,
    Lane,
    RankExited,
    RankExitedData,
)
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS
from lanes_runtime.log import configure_logging
from lanes_runtime.reader import Selection, iter_stream
from lanes_sandbox.embedded import EmbeddedNats

POLL_S = 10.0
PUBLISH_AT_ONCE = 2000


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


async def store_big_job(publisher: LanesClient, job: str, events: int, ranks: int) -> None:
    """A job of `events` events: its submission, rank 7's OOM finding, `ranks` timeouts after it, heartbeats."""
    cause = FindingCause(category="oom_kill", lane=Lane.HOST, node="node-0", rank=7, summary="rank 7 OOM-killed")
    head = [
        JobSubmitted(source="bench", jobid=job, attempt=1, data=JobSubmittedData(spec=JobSpec(name="big", workers=1))),
        JobFinding(
            source="bench",
            jobid=job,
            attempt=1,
            lane=Lane.HOST,
            data=JobFindingData(version=1, first_error=cause, stage="steady_state", confidence=0.9, settled=True),
        ),
    ]
    storm = [
        RankExited(
            source="bench",
            jobid=job,
            attempt=1,
            node=f"node-{rank // 8}",
            rank=rank,
            data=RankExitedData(exit_code=None, signal=6),
        )
        for rank in range(ranks)
        if rank != 7  # noqa: PLR2004 - the OOM-killed rank the finding names
    ]
    beats = max(events - len(head) - len(storm), 0)
    for chunk in (head, storm):
        for at in range(0, len(chunk), PUBLISH_AT_ONCE):
            await asyncio.gather(*(publisher.publish(event) for event in chunk[at : at + PUBLISH_AT_ONCE]))
    for at in range(0, beats, PUBLISH_AT_ONCE):
        await asyncio.gather(
            *(
                publisher.publish(
                    Heartbeat(
                        source="bench",
                        jobid=job,
                        attempt=1,
                        node=f"node-{n % ranks // 8}",
                        rank=n % ranks,
                        data=HeartbeatData(step=n // ranks),
                    )
                )
                for n in range(at, min(at + PUBLISH_AT_ONCE, beats))
            )
        )


async def raw_read_s(nats: EmbeddedNats, job: str) -> tuple[float, int]:
    """The raw baseline: read every stored event of the job once, as one reader, and nothing else."""
    nc = await connect_nats(nats.url_for("console"), name="bench-raw-read")
    try:
        started = time.perf_counter()
        read = 0
        async for _msg in iter_stream(nc.jetstream(), Selection(JOBS.name, f"lanes.job.{job}.>")):
            read += 1
        return time.perf_counter() - started, read
    finally:
        await nc.close()


async def first_paints(url: str, job: str, runs: int) -> list[dict[str, float]]:
    """Open the job page `runs` times in Chromium: time to the caught-up page, rows in the DOM, heap, nodes."""
    from playwright.async_api import async_playwright  # noqa: PLC0415 - only the paint part needs a browser

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise SystemExit("no chromium on PATH")
    results = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=binary, args=["--no-sandbox", "--disable-gpu"])
        try:
            for _ in range(runs):
                context = await browser.new_context(viewport={"width": 1200, "height": 900})
                page = await context.new_page()
                cdp = await context.new_cdp_session(page)
                await cdp.send("Performance.enable")
                started = time.perf_counter()
                await page.goto(f"{url}jobs/{job}")
                await page.wait_for_selector("body[data-caught-up='true']", timeout=120_000)
                await page.wait_for_selector("#groups details.group")
                paint_s = time.perf_counter() - started
                metrics = {m["name"]: m["value"] for m in (await cdp.send("Performance.getMetrics"))["metrics"]}
                results.append(
                    {
                        "first_paint_s": paint_s,
                        "dom_rows": float(await page.locator("#events tbody tr").count()),
                        "js_heap_mb": metrics["JSHeapUsedSize"] / 2**20,
                        "dom_nodes": metrics["Nodes"],
                    }
                )
                await context.close()
        finally:
            await browser.close()
    return results


async def main(ranks: int, runs: int, paint_events: int, paint_runs: int) -> dict[str, object]:
    """Serve the console on an embedded NATS; measure `runs` storms of `ranks` exits and the big job's paint."""
    with EmbeddedNats() as nats:
        reader = await connect_nats(nats.url_for("console"), name="bench-console")
        publisher = await LanesClient.connect(
            nats.url_for("platform"), source="bench", signer=nats.signer_for("platform")
        )
        runner, url = await serve(reader, "127.0.0.1", 0)
        paint: dict[str, object] = {}
        try:
            results = [await one_run(url, nats, publisher, ranks, run) for run in range(runs)]
            if paint_events and (shutil.which("chromium") or shutil.which("chromium-browser")):
                job = f"big-{time.time_ns()}"
                started = time.perf_counter()
                await store_big_job(publisher, job, paint_events, ranks)
                stored_s = time.perf_counter() - started
                raw = [await raw_read_s(nats, job) for _ in range(paint_runs)]
                paints = await first_paints(url, job, paint_runs)
                raw_s = statistics.median(seconds for seconds, _ in raw)
                paint = {
                    "paint_events": raw[0][1],
                    "paint_runs": paint_runs,
                    "paint_stored_s": round(stored_s, 2),
                    **{key: round(statistics.median(p[key] for p in paints), 2) for key in paints[0]},
                    "raw_read_all_s": round(raw_s, 2),
                    "ratio_first_paint_to_raw_read": round(
                        statistics.median(p["first_paint_s"] for p in paints) / max(raw_s, 1e-3), 2
                    ),
                }
            elif paint_events:
                paint = {"paint": "skipped: no chromium on PATH"}
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
        **paint,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--paint-events", type=int, default=100_000)
    parser.add_argument("--paint-runs", type=int, default=3)
    args = parser.parse_args()
    configure_logging("warning")
    print(json.dumps(asyncio.run(main(args.ranks, args.runs, args.paint_events, args.paint_runs))))
