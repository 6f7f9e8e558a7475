"""The service paths at scale, each beside a raw JetStream baseline run on the same servers in the same run.

Prints one JSON object: medians over `--runs` runs (fresh embedded servers per run, or NATS_URL /
DATABASE_URL / REDIS_URL when set) of
- `raw_fetch_ack_per_s` and `raw_publish_consume_per_s`: nats-py alone (the ratios below are against
  these); `raw_batch_pull_fetch_ack_per_s` (and the lifecycle's): fetch+ack through the runtime's
  `BatchPull`, which the services read with and which costs less per message than nats-py's fetch, with the
  ingest and lifecycle ratios against it (`*_ratio_vs_batch_pull`);
- `telemetry_ingest_per_s` / `ingest_ratio`: evidence through the telemetry consumer (bench/telemetry.py);
- `lifecycle_events_per_s` / `lifecycle_ratio`: interleaved job stories through the lifecycle's ordered
  consumer (staged, then folded below the ack floor), against raw fetch+ack of the same messages;
- `admissions_per_s` / `admissions_ratio`: submissions placed by the scheduler (bench/scheduler.py);
- `backlog_decisions_per_s` / `backlog_ratio`: the same number of submissions on half the GPUs they ask for,
  so that half of them wait and every later decision is made with that queue (`backlog_waiting` of them);
- `job_1024_start_s` / `storm_1024_settle_s` and their ratios: one 1,024-rank job's start and failure storm
  through every service (bench/storm.py);
- `rss_mib_after`: the bench process's peak RSS after each phase (every service runs in this process).

    uv run python bench/pipeline.py [--quick] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from baselines.fetch_ack import fetch_ack_rates
from scheduler import end_to_end
from storm import one_run as storm_run
from telemetry import one_ingest_run

from lanes_cli.stack import servers
from lanes_contract.client import publish_encoded
from lanes_contract.codec import encode
from lanes_contract.events import (
    CommunicatorReady,
    CommunicatorReadyData,
    Event,
    Heartbeat,
    HeartbeatData,
    JobPlaced,
    JobPlacedData,
    JobSubmitted,
    JobSubmittedData,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    RendezvousDone,
    RendezvousDoneData,
)
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS
from lanes_lifecycle.domain.job import evolve
from lanes_lifecycle.entrypoints.service import JOB_EVENTS, SERVICE, job_event_handler
from lanes_runtime.consumer import EventConsumer
from lanes_runtime.log import configure_logging
from lanes_runtime.service import connected, settle_heap
from lanes_runtime.settings import ServerUrls, Settings
from lanes_runtime.store import apply_migrations

T0 = datetime(2026, 12, 1, tzinfo=UTC)
RANKS = 4


def story(job_id: str, heartbeats: int) -> list[Event]:
    """One job start to finish: submitted, placed, each rank's start, rendezvous, readiness, steps and exit."""
    events: list[Event] = []

    def add(cls: type[Event], rank: int | None = None, **fields: Any) -> None:
        keys: dict[str, Any] = {"source": "bench", "jobid": job_id, "attempt": 1}
        if rank is not None:
            keys |= {"rank": rank, "node": f"n{rank}"}
        events.append(cls(time=T0 + timedelta(milliseconds=len(events)), **keys, **fields))

    add(JobSubmitted, data=JobSubmittedData(spec=JobSpec(name="bench", workers=RANKS)))
    placement = tuple(RankAssignment(rank=r, node=f"n{r}", gpus=(0,)) for r in range(RANKS))
    add(JobPlaced, data=JobPlacedData(assignments=placement))
    for rank in range(RANKS):
        add(RankStarted, rank, data=RankStartedData(pid=100 + rank))
        add(RendezvousDone, rank, data=RendezvousDoneData(world_size=RANKS))
        add(CommunicatorReady, rank, data=CommunicatorReadyData(backend="nccl"))
    for step in range(heartbeats):
        add(Heartbeat, step % RANKS, data=HeartbeatData(step=step))
    for rank in range(RANKS):
        add(RankExited, rank, data=RankExitedData(exit_code=0))
    return events


async def lifecycle_run(urls: ServerUrls, jobs: int, heartbeats: int) -> dict[str, float]:
    """Interleaved stories of `jobs` jobs: raw fetch+ack of them, then the lifecycle's ordered consumer."""
    async with connected(urls, name="bench-lifecycle") as conns:
        assert SERVICE.migrations is not None  # noqa: S101 - the lifecycle ships its migrations
        await apply_migrations(conns.pool, "lifecycle", SERVICE.migrations)
        js = conns.nc.jetstream()
        run = uuid.uuid4().hex[:6]
        stories = [story(f"l{run}-{j}", heartbeats) for j in range(jobs)]
        interleaved = [s[k] for k in range(len(stories[0])) for s in stories]
        encoded = [encode(e) for e in interleaved]
        for chunk in range(0, len(encoded), 500):
            await asyncio.gather(*(publish_encoded(js, e, stream=JOBS.name) for e in encoded[chunk : chunk + 500]))
        total = len(encoded)

        raw = await fetch_ack_rates(conns.nc, JOBS.name, list(JOB_EVENTS.subjects), total, f"l{run}")

        consumer = EventConsumer(conns.nc, conns.pool, JOB_EVENTS, job_event_handler(js))
        settle_heap()  # as a service does once started
        # Its durable exists before the clock starts, as the raw baselines' do (`run` provisions it again: a no-op).
        await consumer.provision()
        stop = asyncio.Event()
        started = time.perf_counter()
        task = asyncio.create_task(consumer.run(stop))
        expected = _folded_state(stories[0])
        finished = "SELECT count(*) FROM lifecycle_jobs WHERE state = $1 AND job_id LIKE $2"
        while await conns.pool.fetchval(finished, expected, f"l{run}-%") < jobs:  # noqa: ASYNC110 - no event to wait on
            await asyncio.sleep(0.02)
        rate = total / (time.perf_counter() - started)
        stop.set()
        await task
        return {
            "lifecycle_raw_fetch_ack_per_s": raw["nats_py_fetch_ack_per_s"],
            "lifecycle_raw_batch_pull_fetch_ack_per_s": raw["batch_pull_fetch_ack_per_s"],
            "lifecycle_events_per_s": rate,
            "lifecycle_events": total,
        }


def _folded_state(events: list[Event]) -> str:
    view = None
    for event in events:
        view, _ = evolve(view, event)
    assert view is not None  # noqa: S101 - a story starts with its submission
    return view.state.value


def _rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def one_run(quick: bool) -> dict[str, float]:
    """Every phase once, on fresh servers."""
    evidence, jobs, heartbeats, admissions = (2000, 50, 20, 500) if quick else (10000, 200, 40, 2000)
    result: dict[str, float] = {}
    rss: dict[str, float] = {}
    with servers(Settings.from_env()) as urls:
        ingest = asyncio.run(one_ingest_run(urls, evidence))
        result |= {
            "raw_fetch_ack_per_s": ingest["raw_fetch_ack_per_s"],
            "raw_batch_pull_fetch_ack_per_s": ingest["raw_batch_pull_fetch_ack_per_s"],
            "telemetry_ingest_per_s": ingest["ingest_per_s"],
        }
        rss["telemetry"] = _rss_mib()
        result |= asyncio.run(lifecycle_run(urls, jobs, heartbeats))
        rss["lifecycle"] = _rss_mib()
        # Enough GPUs for every submission: none is left waiting to take the backlog phase's GPUs first.
        scheduled = asyncio.run(end_to_end(urls, admissions, nodes=-(-admissions // 8)))
        result |= {
            "admissions_per_s": scheduled["admissions_per_s"],
            "raw_publish_consume_per_s": scheduled["raw_publish_consume_per_s"],
        }
        backlog = asyncio.run(end_to_end(urls, admissions, nodes=admissions // 16))
        result |= {
            "backlog_decisions_per_s": backlog["admissions_per_s"],
            "backlog_raw_publish_consume_per_s": backlog["raw_publish_consume_per_s"],
            "backlog_waiting": admissions - backlog["placed"],
        }
        rss["scheduler"] = _rss_mib()
    # Fresh servers: the services start their consumers at the beginning of the streams, and the phases
    # above left thousands of events there that are not part of this job's story.
    with servers(Settings.from_env()) as urls:
        result |= asyncio.run(storm_run(urls))
        rss["storm"] = _rss_mib()
    result["ingest_ratio"] = result["telemetry_ingest_per_s"] / result["raw_fetch_ack_per_s"]
    result["lifecycle_ratio"] = result["lifecycle_events_per_s"] / result["lifecycle_raw_fetch_ack_per_s"]
    # The same ratios against the raw loop the services read with (BatchPull): the services' own overhead.
    result["ingest_ratio_vs_batch_pull"] = result["telemetry_ingest_per_s"] / result["raw_batch_pull_fetch_ack_per_s"]
    result["lifecycle_ratio_vs_batch_pull"] = (
        result["lifecycle_events_per_s"] / result["lifecycle_raw_batch_pull_fetch_ack_per_s"]
    )
    result["admissions_ratio"] = result["admissions_per_s"] / result["raw_publish_consume_per_s"]
    result["backlog_ratio"] = result["backlog_decisions_per_s"] / result["backlog_raw_publish_consume_per_s"]
    return result | {f"rss_mib_after_{name}": value for name, value in rss.items()}


def main() -> None:
    """Run `--runs` times and print the medians as one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="Smaller volumes (a minute or two per run).")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    configure_logging("warning")
    runs = [one_run(args.quick) for _ in range(args.runs)]
    medians = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
    print(
        json.dumps(
            {
                "bench": "pipeline",
                "quick": args.quick,
                "runs": len(runs),
                "medians": medians,
                "see_also": {"faststream": "bench/faststream_layer.py measures faststream's layer over the runtime"},
            }
        )
    )


if __name__ == "__main__":
    main()
