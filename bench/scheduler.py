"""Gang admission: decision latency of the pure core, admissions/s through NATS, placement quality vs first fit.

1. A synthetic trace on 4,096 nodes x 8 GPUs (NVLink domains of 8 nodes, leaves of 32, spines of 512):
   gangs of 1..512 GPUs with a heavy-tailed size mix, Poisson arrivals and log-normal run times, replayed
   as a discrete-event simulation twice on the same trace: once with Lanes' topology-aware best fit
   (priority queue, reserved head of line, backfill), once with first fit over nodes in id order (the
   walking skeleton's `place_first_fit`, FIFO with the same backfill). Reported per policy: GPU
   utilisation over the busy period, share of gangs placed inside their preferred level, mean wait.
2. Decision latency: every call of the core during the Lanes simulation (place or explain why not).
3. End to end: N submissions through NATS into the real scheduler service (consumer contract,
   PostgreSQL projection, advisory lock, outbox), timed until the last JobPlaced is stored, beside raw
   JetStream publish + consume of the same number of messages on the same server.

    uv run python bench/scheduler.py [--quick] [--runs 3]

The last line of stdout is one JSON object. Servers: NATS_URL / DATABASE_URL / REDIS_URL when set, embedded
otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import statistics
import time
import uuid
from dataclasses import dataclass

from baselines.first_fit import GangRequest, NodeCapacity, place_first_fit
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lanes_cli.stack import servers
from lanes_contract.client import LanesClient
from lanes_contract.codec import encode
from lanes_contract.events import JobSubmitted, JobSubmittedData, NodeRegistered, NodeRegisteredData
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS, NODES
from lanes_contract.topology import ClusterPolicy, Level, Node, TopologyConstraint
from lanes_runtime.consumer import ConsumerSpec, EventConsumer, Outcome
from lanes_runtime.log import configure_logging
from lanes_runtime.service import connected, settle_heap
from lanes_runtime.settings import ServerUrls, Settings
from lanes_runtime.store import apply_migrations
from lanes_scheduler.domain.admission import (
    CapacityView,
    Gang,
    Waiting,
    WaitReason,
    explain,
    place_gang,
    queue_order,
    reservation,
)
from lanes_scheduler.entrypoints.service import SERVICE as SCHEDULER
from lanes_scheduler.entrypoints.service import handlers

GPUS_PER_NODE = 8
NVLINK_NODES, LEAF_NODES, SPINE_NODES = 8, 32, 512
# (GPUs, weight): most jobs are small, a few are very large (the shape of public cluster traces).
SIZE_MIX = ((1, 30), (2, 8), (4, 10), (8, 20), (16, 10), (32, 8), (64, 6), (128, 4), (256, 3), (512, 1))
BACKFILL_DEPTH = 64


def cluster(nodes: int) -> list[Node]:
    """Nodes with NVLink domain / leaf / spine ids by position."""
    return [
        Node(
            node_id=f"n{i:05d}",
            gpu_model="H100",
            gpus=GPUS_PER_NODE,
            gpu_memory_gib=80,
            nvlink_domain=f"nvl{i // NVLINK_NODES:04d}",
            leaf=f"leaf{i // LEAF_NODES:03d}",
            spine=f"spine{i // SPINE_NODES:02d}",
        )
        for i in range(nodes)
    ]


def preferred_level(gpus: int) -> Level:
    """Where a gang of this size communicates well: one node, one NVLink domain, one leaf, one spine."""
    if gpus <= GPUS_PER_NODE:
        return Level.NODE
    if gpus <= GPUS_PER_NODE * NVLINK_NODES:
        return Level.NVLINK
    if gpus <= GPUS_PER_NODE * LEAF_NODES:
        return Level.LEAF
    return Level.SPINE


@dataclass(frozen=True)
class Arrival:
    """One job of the trace."""

    gang: Gang
    at: float
    runtime: float


def trace(jobs: int, total_gpus: int, load: float, seed: int) -> list[Arrival]:
    """Poisson arrivals at `load` x capacity, log-normal run times, sizes from SIZE_MIX."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible trace, not a secret
    sizes, weights = zip(*SIZE_MIX, strict=True)
    mean_gpus = sum(s * w for s, w in SIZE_MIX) / sum(weights)
    mean_runtime = 100.0
    rate = load * total_gpus / (mean_gpus * mean_runtime)
    now, out = 0.0, []
    for i in range(jobs):
        now += rng.expovariate(rate)
        gpus = rng.choices(sizes, weights)[0]
        workers, per = (1, gpus) if gpus <= GPUS_PER_NODE else (gpus // GPUS_PER_NODE, GPUS_PER_NODE)
        topology = TopologyConstraint(preferred=(preferred_level(gpus),))
        gang = Gang(job_id=f"j{i}", attempt=1, workers=workers, gpus_per_worker=per, order=i, topology=topology)
        out.append(Arrival(gang, now, rng.lognormvariate(0, 0.8) * mean_runtime / 1.377))
    return out


def _level_of(nodes: dict[str, Node], placed_nodes: set[str]) -> Level:
    for level in (Level.NODE, Level.NVLINK, Level.LEAF, Level.SPINE):
        if len({nodes[n].domain(level) for n in placed_nodes}) == 1:
            return level
    return Level.CLUSTER


def simulate(  # noqa: PLR0915 - one discrete-event loop, read top to bottom
    arrivals: list[Arrival], nodes: list[Node], policy: str
) -> dict[str, float | list[float]]:
    """Replay the trace with `lanes` (best fit + reservation) or `first_fit`; return quality and latencies."""
    view = CapacityView(nodes, ClusterPolicy())
    by_id = {n.node_id: n for n in nodes}
    total = len(nodes) * GPUS_PER_NODE
    events: list[tuple[float, int, str, int]] = [(a.at, 0, "arrive", i) for i, a in enumerate(arrivals)]
    heapq.heapify(events)
    queue: list[Gang] = []
    started: dict[str, float] = {}
    latencies: list[float] = []
    in_preferred = placed = 0
    busy_gpu_time = 0.0
    used = 0
    last_t = arrivals[0].at
    index = {a.gang.job_id: a for a in arrivals}
    window_end = arrivals[-1].at  # utilisation is measured while work keeps arriving, not during the drain
    while events:
        t, _, kind, i = heapq.heappop(events)
        busy_gpu_time += used * (min(t, window_end) - min(last_t, window_end))
        last_t = t
        if kind == "arrive":
            queue.append(arrivals[i].gang)
        else:
            gang = arrivals[i].gang
            used -= gang.gpus
            view.release(gang.key)
        excluded: frozenset[str] = frozenset()
        remaining: list[Gang] = []
        ordered = queue_order(queue)
        for position, gang in enumerate(ordered):
            if position >= BACKFILL_DEPTH:
                remaining.extend(ordered[position:])
                break
            began = time.perf_counter()
            if policy == "lanes":
                decision = place_gang(view, gang, excluded)
                assignments = decision.assignments if decision else None
                if decision is None:
                    why = explain(view, gang, excluded)
                    if (
                        not excluded
                        and isinstance(why, Waiting)
                        and why.reason
                        in {
                            WaitReason.CAPACITY_SHORT,
                            WaitReason.TOPOLOGY_UNSATISFIABLE,
                        }
                    ):
                        excluded = reservation(view, gang)
            else:
                capacity = tuple(
                    NodeCapacity(n, "H100", 80, tuple(view.free[n]))
                    for n in view.free
                    if n not in excluded and view.free[n]
                )
                result = place_first_fit(
                    GangRequest(gang.workers, gang.gpus_per_worker), capacity, dict.fromkeys(view.free, GPUS_PER_NODE)
                )
                assignments = result if isinstance(result, tuple) else None
                if assignments is None and not excluded:
                    excluded = reservation(view, gang)
            latencies.append((time.perf_counter() - began) * 1000)
            if assignments is None:
                remaining.append(gang)
                continue
            view.hold(gang, assignments)
            used += gang.gpus
            placed += 1
            in_preferred += _level_of(by_id, {a.node for a in assignments}).rank <= gang.topology.preferred_level.rank
            started[gang.job_id] = t
            heapq.heappush(events, (t + index[gang.job_id].runtime, 1, "finish", int(gang.job_id[1:])))
        queue = remaining
    span = window_end - arrivals[0].at
    waits = [started[a.gang.job_id] - a.at for a in arrivals if a.gang.job_id in started]
    return {
        "utilisation": busy_gpu_time / (total * span),
        "preferred_share": in_preferred / max(placed, 1),
        "mean_wait_s": statistics.fmean(waits),
        "placed": placed,
        "latencies": latencies,
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def end_to_end(urls: ServerUrls, jobs: int, nodes: int = 64) -> dict[str, float]:
    """Decisions/s through the scheduler service on real servers, beside raw publish + consume.

    `jobs` one-GPU submissions on `nodes` nodes of 8 GPUs: with fewer GPUs than jobs, the rest wait, and
    each later decision is made with that backlog in the queue.
    """
    tag = uuid.uuid4().hex[:8]
    async with connected(urls, name="bench-scheduler") as conns:
        if SCHEDULER.migrations is not None:
            await apply_migrations(conns.pool, "scheduler", SCHEDULER.migrations)
        js = conns.nc.jetstream()
        client = LanesClient(conns.nc, "bench")
        node_ids = [f"b{tag}-n{i:03d}" for i in range(nodes)]
        for i, node in enumerate(node_ids):
            data = NodeRegisteredData(gpu_model="H100", gpus=8, gpu_memory_gib=80, leaf=f"b{tag}-leaf{i // 32}")
            await client.publish(NodeRegistered(source="bench", node=node, data=data))
        job_ids = [f"b{tag}-j{i}" for i in range(jobs)]
        # The consumer reads exactly this run's submissions (a subject wildcard cannot select by job-id prefix).
        job_spec = ConsumerSpec(
            durable=f"bench-jobs-{tag}", stream=JOBS, subjects=tuple(f"lanes.job.{j}.submitted" for j in job_ids)
        )
        node_spec = ConsumerSpec(
            durable=f"bench-nodes-{tag}", stream=NODES, subjects=tuple(f"lanes.node.{n}.registered" for n in node_ids)
        )
        stop = asyncio.Event()
        handle_job_event, handle_node_event = handlers()
        node_consumer = EventConsumer(conns.nc, conns.pool, node_spec, handle_node_event)
        node_task = asyncio.create_task(node_consumer.run(stop))
        registered = "SELECT count(*) FROM scheduler_nodes WHERE node_id LIKE $1"
        while await conns.pool.fetchval(registered, f"b{tag}-%") < len(node_ids):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        spec = JobSpec(name="bench", workers=1, gpus_per_worker=1)
        events = [JobSubmitted(source="bench", jobid=j, attempt=1, data=JobSubmittedData(spec=spec)) for j in job_ids]
        for chunk in range(0, len(events), 200):
            await asyncio.gather(*(client.publish(e) for e in events[chunk : chunk + 200]))
        consumer = EventConsumer(conns.nc, conns.pool, job_spec, handle_job_event)
        settle_heap()  # as a service does once started
        began = time.perf_counter()
        task = asyncio.create_task(consumer.run(stop))
        while consumer.outcomes[Outcome.PROCESSED] < jobs:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - began
        placed = await conns.pool.fetchval(
            "SELECT count(*) FROM scheduler_jobs WHERE status = 'placed' AND job_id LIKE $1", f"b{tag}-%"
        )
        stop.set()
        await asyncio.gather(task, node_task, return_exceptions=True)

        # The raw baseline moves the same messages (submissions, encoded) through the same stream with nats-py
        # alone. It reads only what it publishes (a consumer that starts at new messages), and it needs no
        # stream of its own: only the admin may create streams.
        # (new ids: the same ids would be JetStream duplicates, acknowledged and never stored)
        raw = [encode(e.model_copy(update={"id": new_event_id(), "jobid": f"{e.job_key}-raw"})) for e in events]
        raw_durable = f"raw-{tag}"
        raw_config = ConsumerConfig(
            durable_name=raw_durable,
            filter_subject="lanes.job.*.submitted",
            deliver_policy=DeliverPolicy.NEW,
            ack_policy=AckPolicy.EXPLICIT,
        )
        await js.add_consumer(JOBS.name, config=raw_config)
        sub = await js.pull_subscribe_bind(raw_durable, stream=JOBS.name)
        began = time.perf_counter()
        for chunk in range(0, jobs, 200):
            await asyncio.gather(
                *(js.publish(m.subject, m.payload, headers=m.headers) for m in raw[chunk : chunk + 200])
            )
        consumed = 0
        while consumed < jobs:
            for msg in await sub.fetch(64, timeout=5):
                await msg.ack()
                consumed += 1
        raw_elapsed = time.perf_counter() - began
        await js.delete_consumer(JOBS.name, raw_durable)
        for durable, stream in ((job_spec.durable, JOBS.name), (node_spec.durable, NODES.name)):
            await js.delete_consumer(stream, durable)
    return {
        "admissions_per_s": jobs / elapsed,
        "raw_publish_consume_per_s": jobs / raw_elapsed,
        "placed": float(placed),
    }


def main() -> None:
    """Run the bench and print the JSON result as the last line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller trace (under a minute)")
    parser.add_argument("--runs", type=int, default=1, help="end-to-end runs (the median is reported)")
    args = parser.parse_args()
    configure_logging("warning", "json")
    node_count = 1024 if args.quick else 4096
    jobs = 1500 if args.quick else 6000
    e2e_jobs = 300 if args.quick else 1000
    nodes = cluster(node_count)
    arrivals = trace(jobs, node_count * GPUS_PER_NODE, load=1.1, seed=7)
    lanes = simulate(arrivals, nodes, "lanes")
    first_fit = simulate(arrivals, nodes, "first_fit")
    latencies = lanes["latencies"]
    if not isinstance(latencies, list):
        raise TypeError(latencies)
    settings = Settings.from_env()
    with servers(settings) as urls:
        # GPUs for every submission, so no run leaves jobs waiting ahead of the next run's.
        runs = [asyncio.run(end_to_end(urls, e2e_jobs, nodes=-(-e2e_jobs // 8))) for _ in range(args.runs)]
    admissions = statistics.median(r["admissions_per_s"] for r in runs)
    raw = statistics.median(r["raw_publish_consume_per_s"] for r in runs)
    result = {
        "nodes": node_count,
        "gpus": node_count * GPUS_PER_NODE,
        "trace_jobs": jobs,
        "decisions": len(latencies),
        "decision_p50_ms": round(_percentile(latencies, 0.50), 3),
        "decision_p99_ms": round(_percentile(latencies, 0.99), 3),
        "admissions_per_s": round(admissions, 1),
        "raw_publish_consume_per_s": round(raw, 1),
        "admissions_ratio": round(admissions / raw, 3),
        "e2e_jobs": e2e_jobs,
        "preferred_share": round(float(lanes["preferred_share"]), 3),  # type: ignore[arg-type]
        "preferred_share_first_fit": round(float(first_fit["preferred_share"]), 3),  # type: ignore[arg-type]
        "utilisation": round(float(lanes["utilisation"]), 3),  # type: ignore[arg-type]
        "utilisation_first_fit": round(float(first_fit["utilisation"]), 3),  # type: ignore[arg-type]
        "mean_wait_s": round(float(lanes["mean_wait_s"]), 1),  # type: ignore[arg-type]
        "mean_wait_s_first_fit": round(float(first_fit["mean_wait_s"]), 1),  # type: ignore[arg-type]
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
