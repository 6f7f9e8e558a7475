"""A 1,024-rank job through every service: its start, then its failure storm, each beside raw nats-py.

- `job_1024_start_s`: submit to `running` for one job of 1,024 ranks on 128 nodes of 8 GPUs, with the
  scheduler, lifecycle, telemetry and recovery running (all in this process, as in `lanes demo`). The node
  agents' part is played here: once the job is placed, every rank's start, rendezvous and communicator
  readiness is published (3,072 events), as 128 agents would.
- `storm_1024_settle_s`: one rank is OOM-killed. The kernel's line names its pid; the other 1,023 ranks each
  log a collective timeout and abort; every rank's exit follows (2,048 more events). Timed from the first
  storm event to a *settled* finding that names the killed rank, host lane, OOM.
- Beside each, in the same run on the same servers, `*_raw_s`: the same number of encoded events published
  and then fetched and acked with nats-py alone, and `*_ratio` = raw / service time (1.0 would be "the
  services cost nothing beyond moving the bytes").

    uv run python bench/storm.py [--runs 3]

Prints one JSON object (medians). bench/pipeline.py runs it too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lanes_cli.bootstrap import prepare_services
from lanes_cli.stack import servers
from lanes_contract.client import configured_signer, publish_encoded
from lanes_contract.codec import EncodedEvent, decode, encode
from lanes_contract.events import (
    CommunicatorReady,
    CommunicatorReadyData,
    Event,
    EvidenceCategory,
    EvidenceData,
    HostEvidence,
    JobPlaced,
    JobSubmitted,
    JobSubmittedData,
    Lane,
    NodeRegistered,
    NodeRegisteredData,
    ProcessEvidence,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    RendezvousDone,
    RendezvousDoneData,
    utc_now,
)
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS, TELEMETRY
from lanes_runtime.log import configure_logging
from lanes_runtime.service import connected, run_consumers, settle_heap
from lanes_runtime.settings import ServerUrls, Settings

NODES_COUNT = 128
GPUS_PER_NODE = 8
RANKS = NODES_COUNT * GPUS_PER_NODE
VICTIM = 517
PID_BASE = 30_000
SERVICES = ("scheduler", "lifecycle", "telemetry", "recovery")
_CHUNK = 500


async def _publish(js: JetStreamContext, events: Sequence[Event]) -> None:
    """Publish in order-insensitive chunks (each chunk's publishes in flight together), as many agents would."""
    for chunk in range(0, len(events), _CHUNK):
        await asyncio.gather(*(publish_encoded(js, encode(e)) for e in events[chunk : chunk + _CHUNK]))


async def _raw_move(js: JetStreamContext, events: Sequence[Event], tag: str) -> float:
    """Seconds to publish the same number of encoded events and fetch + ack them, with nats-py alone."""
    # New ids (the same ids would be duplicates JetStream acknowledges without storing) on the telemetry
    # stream under a node name no service reads.
    node = f"raw-{tag}"
    encoded: list[EncodedEvent] = [
        encode(HostEvidence(id=new_event_id(), source="bench", node=node, data=e.data))
        if isinstance(e, HostEvidence | ProcessEvidence)
        else encode(
            HostEvidence(
                id=new_event_id(),
                source="bench",
                node=node,
                data=EvidenceData(category=EvidenceCategory.RAW, lines=(e.model_dump_json()[:200],)),
            )
        )
        for e in events
    ]
    # Signed before the clock starts, as a producer's events are: the telemetry service verifies what it reads,
    # these included (unsigned, each would be dead-lettered), and the baseline's cost stays nats-py's alone.
    if (signer := configured_signer()) is not None:
        encoded = [signer.sign(message) for message in encoded]
    durable = f"raw-{tag}"
    config = ConsumerConfig(
        durable_name=durable,
        filter_subject=f"lanes.tel.{node}.>",
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        max_ack_pending=1024,
    )
    began = time.perf_counter()
    for chunk in range(0, len(encoded), _CHUNK):
        await asyncio.gather(
            *(js.publish(m.subject, m.payload, headers=m.headers) for m in encoded[chunk : chunk + _CHUNK])
        )
    await js.add_consumer(TELEMETRY.name, config=config)
    sub = await js.pull_subscribe_bind(durable, stream=TELEMETRY.name)
    seen = 0
    while seen < len(encoded):
        for msg in await sub.fetch(256, timeout=5):
            await msg.ack()
            seen += 1
    elapsed = time.perf_counter() - began
    await js.delete_consumer(TELEMETRY.name, durable)
    return elapsed


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            msg = f"timed out waiting for {what}"
            raise TimeoutError(msg)
        await asyncio.sleep(0.02)


def _node(rank: int, tag: str) -> str:
    return f"s{tag}-n{rank // GPUS_PER_NODE}"


def _agent_events(placed: JobPlaced, job_id: str) -> list[Event]:
    """Every rank's start, rendezvous and readiness, in that order across the gang (as agents report them)."""
    world = len(placed.data.assignments)
    ranks = [(a.rank, a.node) for a in placed.data.assignments]
    started: list[Event] = [
        RankStarted(
            source=f"agent/{n}", jobid=job_id, attempt=1, rank=r, node=n, data=RankStartedData(pid=PID_BASE + r)
        )
        for r, n in ranks
    ]
    met: list[Event] = [
        RendezvousDone(
            source=f"agent/{n}", jobid=job_id, attempt=1, rank=r, node=n, data=RendezvousDoneData(world_size=world)
        )
        for r, n in ranks
    ]
    ready: list[Event] = [
        CommunicatorReady(
            source=f"agent/{n}", jobid=job_id, attempt=1, rank=r, node=n, data=CommunicatorReadyData(backend="nccl")
        )
        for r, n in ranks
    ]
    return [*started, *met, *ready]


def _storm(placed: JobPlaced, job_id: str) -> list[Event]:
    """The kernel line, 1,023 timeouts, then every exit (each exit says how much evidence its rank sent)."""
    node_of = {a.rank: a.node for a in placed.data.assignments}
    now = utc_now()
    victim_node = node_of[VICTIM]
    kernel = HostEvidence(
        source=f"agent/{victim_node}",
        node=victim_node,
        time=now,
        data=EvidenceData(
            category=EvidenceCategory.OOM_KILL,
            pid=PID_BASE + VICTIM,
            summary=f"Memory cgroup out of memory: Killed process {PID_BASE + VICTIM} (python)",
            lines=(f"Memory cgroup out of memory: Killed process {PID_BASE + VICTIM} (python)",),
        ),
    )
    timeouts: list[Event] = [
        ProcessEvidence(
            source=f"agent/{node}",
            jobid=job_id,
            attempt=1,
            rank=rank,
            node=node,
            time=now,
            lane=Lane.NETWORK,
            data=EvidenceData(
                category=EvidenceCategory.COLLECTIVE_TIMEOUT,
                op_type="ALLREDUCE",
                seq_num=1580,
                timeout_ms=600_000,
                lines=(f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580)",),
            ),
        )
        for rank, node in sorted(node_of.items())
        if rank != VICTIM
    ]
    exits: list[Event] = [
        RankExited(
            source=f"agent/{node}",
            jobid=job_id,
            attempt=1,
            rank=rank,
            node=node,
            data=RankExitedData(
                exit_code=None,
                signal=signal.SIGKILL if rank == VICTIM else signal.SIGABRT,
                evidence=0 if rank == VICTIM else 1,
            ),
        )
        for rank, node in sorted(node_of.items())
    ]
    return [kernel, *timeouts, *exits]


def _nodes(tag: str) -> list[Event]:
    """The run's fleet, sixteen nodes a leaf."""
    return [
        NodeRegistered(
            source="bench",
            node=f"s{tag}-n{i}",
            data=NodeRegisteredData(gpu_model="H100", gpus=GPUS_PER_NODE, gpu_memory_gib=80, leaf=f"leaf{i // 16}"),
        )
        for i in range(NODES_COUNT)
    ]


async def one_run(urls: ServerUrls) -> dict[str, float]:
    """One job: its start, then its storm, each beside the raw baseline."""
    tag = uuid.uuid4().hex[:6]
    job_id = f"storm-{tag}"
    async with connected(urls, name="bench-storm") as conns:
        js = conns.nc.jetstream()
        runners = await prepare_services(conns, SERVICES)
        settle_heap()  # as a service does once started
        stop = asyncio.Event()
        services = asyncio.create_task(run_consumers(runners, stop))
        try:
            await _publish(js, _nodes(tag))

            async def registered() -> bool:
                known = "SELECT count(*) FROM scheduler_nodes WHERE node_id LIKE $1"
                return int(await conns.pool.fetchval(known, f"s{tag}-n%")) == NODES_COUNT

            await _until(registered, "the nodes registered")

            spec = JobSpec(name="storm", workers=RANKS, gpus_per_worker=1)
            began = time.perf_counter()
            await _publish(
                js, [JobSubmitted(source="bench", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))]
            )
            placed: JobPlaced | None = None

            async def is_placed() -> bool:
                nonlocal placed
                placed = await _placed(js, job_id)
                return placed is not None

            await _until(is_placed, "the placement")
            assert placed is not None  # noqa: S101 - set by is_placed
            started = _agent_events(placed, job_id)
            await _publish(js, started)

            async def running() -> bool:
                state = await conns.pool.fetchval("SELECT state FROM lifecycle_jobs WHERE job_id = $1", job_id)
                return state in {"running", "failed", "partially_failed"}

            await _until(running, "running")
            start_s = time.perf_counter() - began
            start_raw_s = await _raw_move(js, [*started, placed], f"{tag}s")

            storm = _storm(placed, job_id)
            began = time.perf_counter()
            await _publish(js, storm)

            async def settled() -> bool:
                row = await conns.pool.fetchval(
                    "SELECT finding FROM telemetry_findings WHERE job_id = $1 AND attempt = 1", job_id
                )
                return row is not None and json.loads(row).get("settled") is True

            await _until(settled, "a settled finding")
            storm_s = time.perf_counter() - began
            finding = json.loads(
                await conns.pool.fetchval("SELECT finding FROM telemetry_findings WHERE job_id = $1", job_id)
            )
            first = finding["first_error"]
            if (first["category"], first["lane"], first["rank"]) != ("oom_kill", "host", VICTIM):
                msg = f"the storm's finding is wrong: {first}"
                raise AssertionError(msg)
            if not finding["settle_reason"].startswith("every rank"):
                # Settled by the window running out would time the window, not the pipeline.
                msg = f"the storm's finding settled by its window, not its evidence: {finding['settle_reason']}"
                raise AssertionError(msg)
            storm_raw_s = await _raw_move(js, storm, f"{tag}f")
        finally:
            stop.set()
            await services
    return {
        "job_1024_start_s": start_s,
        "job_1024_start_raw_s": start_raw_s,
        "job_1024_start_ratio": start_raw_s / start_s,
        "storm_1024_settle_s": storm_s,
        "storm_1024_raw_s": storm_raw_s,
        "storm_1024_ratio": storm_raw_s / storm_s,
        "storm_events": float(len(storm)),
    }


async def _placed(js: JetStreamContext, job_id: str) -> JobPlaced | None:
    """The job's placement, read from its subject (None until the scheduler placed it)."""
    try:
        msg = await js.get_last_msg(JOBS.name, f"lanes.job.{job_id}.placed")
    except Exception:  # noqa: BLE001 - not there yet
        return None
    event = decode(msg.subject or "", msg.headers, msg.data or b"")
    return event if isinstance(event, JobPlaced) else None


def main() -> None:
    """Run `--runs` times on fresh servers and print the medians as one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    configure_logging("warning")
    runs = []
    for _ in range(args.runs):
        with servers(Settings.from_env()) as urls:
            runs.append(asyncio.run(one_run(urls)))
    medians = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
    print(json.dumps({"bench": "storm", "runs": len(runs), "medians": medians, "nodes": NODES_COUNT, "ranks": RANKS}))


if __name__ == "__main__":
    main()
