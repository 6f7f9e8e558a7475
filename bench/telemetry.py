"""Telemetry: first-error election at 1,024 ranks / 20,000 evidence events, and ingest vs raw fetch+ack.

- Election: the pure `elect_first_error` over 20,000 evidence events from 1,024 ranks on 128 nodes (one
  rank OOM-killed, the others timing out, aborting and logging), median of several runs. Target <= 1 s.
- Ingest, end to end: evidence already on LANES_TELEMETRY is consumed by the telemetry handler under the
  consumer contract (decode, one transaction: processed record + evidence row + correlation to the
  placement + reporters / election when due + outbox; then the correlated copy and any finding are
  published, and the message acked). Beside it, in the same run on the same server, raw nats-py
  fetch + ack of the same messages. Target ratio >= 0.6.
- Signed (`--signed`): every evidence event is signed by its node's agent key, and the consumer verifies
  each against a keyring before its handler, as the services do under `lanes up`. The raw baseline stays
  nats-py's fetch+ack alone, so the ratio includes the verification.
- Batched sketch: the same work per fetched batch in one transaction (`batched_sketch`), to size what a
  batch consumer contract would buy; it is not the service path.

    uv run python bench/telemetry.py [--quick] [--signed] [--events 4000] [--runs 3]

The last line of stdout is one JSON object. Servers: NATS_URL / DATABASE_URL / REDIS_URL when set,
embedded otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

from baselines.fetch_ack import fetch_ack_rates
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lanes_cli.stack import servers
from lanes_contract.client import configured_signer, publish_encoded, sign_with
from lanes_contract.codec import EncodedEvent, decode, encode
from lanes_contract.events import (
    EvidenceCategory,
    EvidenceData,
    JobEvidence,
    JobEvidenceData,
    JobPlaced,
    JobPlacedData,
    RankAssignment,
    derive,
)
from lanes_contract.identities import AGENT_PREFIX
from lanes_contract.signing import EventSigner, Keyring
from lanes_contract.streams import JOBS, TELEMETRY
from lanes_evidence.evidence import Evidence, evidence_event, from_event
from lanes_runtime.consumer import ConsumerSpec, EventConsumer, Outcome
from lanes_runtime.log import configure_logging
from lanes_runtime.service import Connections, connected, settle_heap
from lanes_runtime.settings import ServerUrls, Settings
from lanes_runtime.store import apply_migrations
from lanes_telemetry.adapters import repository
from lanes_telemetry.domain.election import World, elect_first_error
from lanes_telemetry.entrypoints.service import EVENTS, SERVICE
from lanes_telemetry.service_layer.handlers import CORRELATION_SKEW, NOT_ELECTED, handle_evidence, handle_job_event

C = EvidenceCategory
RANKS, RANKS_PER_NODE = 1024, 8
T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
VICTIM = 515


def synthetic_job(events: int, prefix: str = "node") -> tuple[list[Evidence], World]:
    """`events` pieces of evidence from a 1,024-rank job in which one rank is OOM-killed."""
    world = World(ranks={r: f"{prefix}-{r // RANKS_PER_NODE}" for r in range(RANKS)})
    victim_node = world.ranks[VICTIM]
    found = [
        Evidence(
            EvidenceData(category=C.OOM_KILL, pid=40000 + VICTIM, lines=("Out of memory: Killed process",)),
            T0,
            victim_node,
        ),
        Evidence(
            EvidenceData(category=C.PROCESS_EXITED, signal=9, pid=40000 + VICTIM, lines=("exitcode  : -9",)),
            T0 + timedelta(seconds=1),
            victim_node,
            VICTIM,
        ),
    ]
    kinds = (
        EvidenceData(
            category=C.COLLECTIVE_TIMEOUT,
            op_type="ALLREDUCE",
            seq_num=1580,
            timeout_ms=600000,
            lines=("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, ...)",),
        ),
        EvidenceData(
            category=C.COLLECTIVE_TIMEOUT,
            seq_num=1580,
            last_enqueued=1580,
            last_completed=1579,
            lines=("Timeout at NCCL work: 1580, last enqueued NCCL work: 1580, last completed NCCL work: 1579.",),
        ),
        EvidenceData(category=C.COMM_ERROR, lines=("Some NCCL operations have failed or timed out.",)),
        EvidenceData(category=C.PROCESS_EXITED, signal=6, lines=("Signal 6 (SIGABRT) received",)),
        EvidenceData(category=C.RAW, lines=("NCCL INFO comm 0x55 rank r nranks 1024 - Init COMPLETE",)),
    )
    index = 0
    while len(found) < events:
        rank = index % RANKS
        if rank != VICTIM:
            data = kinds[(index // RANKS) % len(kinds)]
            at = T0 + timedelta(seconds=600, milliseconds=index % 997)
            found.append(Evidence(data, at, world.ranks[rank], rank))
        index += 1
    return found, world


def bench_election(runs: int) -> dict[str, float]:
    """Median seconds to elect over 20,000 evidence events of a 1,024-rank job; checks the answer."""
    evidence, world = synthetic_job(20_000)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        finding = elect_first_error(evidence, world=world)
        times.append(time.perf_counter() - started)
        first = finding.first_error
        if first is None or (first.category, first.rank) != ("oom_kill", VICTIM):
            msg = f"wrong election: {first}"
            raise AssertionError(msg)
    return {"election_s_1024_ranks": round(statistics.median(times), 4), "election_evidence": len(evidence)}


async def _publish_all(js: JetStreamContext, encoded: list[EncodedEvent]) -> None:
    for chunk in range(0, len(encoded), 500):
        await asyncio.gather(*(publish_encoded(js, e, stream=TELEMETRY.name) for e in encoded[chunk : chunk + 500]))


def _signed_by_agents(evidence: list[Evidence]) -> tuple[list[EncodedEvent], Keyring]:
    """Each event from its node's agent (`agent/<node>`), signed with that agent's key; the keyring of them all."""
    signers = {node: EventSigner.generate(f"{AGENT_PREFIX}{node}") for node in sorted({e.node or "" for e in evidence})}
    encoded = [
        signers[e.node or ""].sign(encode(evidence_event(e, source=f"agent/{e.node}", node=e.node or "", time=T0)))
        for e in evidence
    ]
    return encoded, Keyring({s.reference: s.public_key for s in signers.values()})


async def one_ingest_run(urls: ServerUrls, events: int, *, signed: bool = False) -> dict[str, float]:
    """Publish `events` evidence events of one placed job; time raw fetch+ack, then the telemetry handler."""
    async with connected(urls, name="bench-telemetry") as conns:
        if SERVICE.migrations is not None:
            await apply_migrations(conns.pool, SERVICE.name, SERVICE.migrations)
        js = conns.nc.jetstream()
        run = uuid.uuid4().hex[:8]
        evidence, world = synthetic_job(events, prefix=f"b{run}")
        job_id = f"bench-{run}"
        placement = JobPlaced(
            source="bench",
            jobid=job_id,
            attempt=1,
            time=T0 - timedelta(minutes=5),
            data=JobPlacedData(
                assignments=tuple(
                    RankAssignment(rank=r, node=n or "", gpus=(r % RANKS_PER_NODE,)) for r, n in world.ranks.items()
                )
            ),
        )
        placements = EventConsumer(
            conns.nc,
            conns.pool,
            ConsumerSpec(durable=f"bench-placements-{run}", stream=JOBS, subjects=(f"lanes.job.{job_id}.placed",)),
            handle_job_event,
        )
        await publish_encoded(js, encode(placement), stream=JOBS.name)
        stop = asyncio.Event()
        task = asyncio.create_task(placements.run(stop))
        while placements.outcomes[Outcome.PROCESSED] < 1:  # noqa: ASYNC110 - the consumer exposes counts only
            await asyncio.sleep(0.01)
        stop.set()
        await task

        keyring: Keyring | None = None
        if signed:
            encoded, keyring = _signed_by_agents(evidence)
        else:
            encoded = [encode(evidence_event(e, source="bench", node=e.node or "", time=T0)) for e in evidence]
        if signed:
            sign_with(conns.nc, None)  # published as the agents signed them, not re-signed by this connection
        await _publish_all(js, encoded)
        sign_with(conns.nc, configured_signer())  # the service's outputs are signed, as under `lanes up`
        subjects = tuple(sorted({f"lanes.tel.{node}.>" for node in world.ranks.values()}))

        raw = await fetch_ack_rates(conns.nc, TELEMETRY.name, list(subjects), events, run)

        # The service's own evidence consumer (batch, batches in flight), on this run's durable and nodes.
        spec = dataclasses.replace(EVENTS, durable=f"bench-tel-{run}", subjects=subjects)
        consumer = EventConsumer(conns.nc, conns.pool, spec, handle_evidence, keyring=keyring)
        settle_heap()  # as a service does once started
        # Its durable exists before the clock starts, as the raw baselines' do (`run` provisions it again: a no-op).
        await consumer.provision()
        stop = asyncio.Event()
        started = time.perf_counter()
        task = asyncio.create_task(consumer.run(stop))
        while consumer.outcomes[Outcome.PROCESSED] < events:
            if consumer.outcomes[Outcome.DEAD_LETTERED]:
                msg = f"{consumer.outcomes[Outcome.DEAD_LETTERED]} evidence events were dead-lettered (see the log)"
                raise AssertionError(msg)
            await asyncio.sleep(0.01)
        ingest_rate = events / (time.perf_counter() - started)
        stop.set()
        await task
        correlated = await conns.pool.fetchval("SELECT count(*) FROM telemetry_evidence WHERE job_id = $1", job_id)
        if correlated != events:
            problem = f"only {correlated} of {events} evidence events were correlated to the job"
            raise AssertionError(problem)
        # The sketch writes the same rows again: start it from an empty table.
        await conns.pool.execute("DELETE FROM telemetry_evidence WHERE job_id = $1", job_id)
        sketch_rate = await batched_sketch(conns, run, subjects, events, job_id)
        return {
            "raw_fetch_ack_per_s": raw["nats_py_fetch_ack_per_s"],
            "raw_batch_pull_fetch_ack_per_s": raw["batch_pull_fetch_ack_per_s"],
            "ingest_per_s": round(ingest_rate),
            "batched_sketch_per_s": round(sketch_rate),
        }


async def batched_sketch(conns: Connections, run: str, subjects: tuple[str, ...], events: int, job_id: str) -> float:
    """What a batch contract could reach: the same work per fetched batch in one transaction.

    NOT the service path (the consumer contract is per message): a sketch to size the change. Per batch:
    one multi-row processed-record insert, one lock + placement lookup per distinct node, one pipelined
    evidence insert, one pipelined outbox insert, one election per attempt, one commit; then the copies
    are published concurrently, the outbox rows deleted in one statement and the messages acked together.
    """
    js = conns.nc.jetstream()
    config = ConsumerConfig(
        durable_name=f"sketch-{run}",
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        filter_subjects=list(subjects),
        max_ack_pending=1024,
    )
    await js.add_consumer(TELEMETRY.name, config=config)
    sub = await js.pull_subscribe_bind(config.durable_name or "", stream=TELEMETRY.name)
    durable = config.durable_name or ""
    started, done = time.perf_counter(), 0
    while done < events:
        msgs = await sub.fetch(256, timeout=5)
        decoded = [(msg, decode(msg.subject, msg.headers, msg.data)) for msg in msgs]
        async with conns.pool.acquire() as conn, conn.transaction():
            fresh = {
                row["event_id"]
                for row in await conn.fetch(
                    """INSERT INTO lanes_processed (consumer, event_id, stream, stream_seq)
                       SELECT $1, e, $2, s FROM unnest($3::text[], $4::bigint[]) AS t(e, s)
                       ON CONFLICT DO NOTHING RETURNING event_id""",
                    durable,
                    TELEMETRY.name,
                    [event.id for _, event in decoded],
                    [msg.metadata.sequence.stream for msg, _ in decoded],
                )
            }
            batch = [event for _, event in decoded if event.id in fresh]
            nodes = sorted({event.node_key for event in batch})
            await repository.PostgresTelemetryStore(conn).lock_nodes(nodes, exclusive=False)
            latest = max((event.time for event in batch), default=T0)
            placed = {
                node: await repository.PostgresTelemetryStore(conn).placement_at(node, latest, CORRELATION_SKEW)
                for node in nodes
            }
            rows, copies = [], []
            for event in batch:
                placement = placed[event.node_key]
                evidence = from_event(event)
                rank = evidence.rank if evidence.rank is not None else (placement.only_rank if placement else None)
                rows.append(
                    (
                        event.id,
                        event.node_key,
                        evidence.kind,
                        evidence.category.value,
                        event.time,
                        event.lane.value,
                        placement.job_id if placement else None,
                        placement.attempt if placement else None,
                        rank,
                        evidence.data.model_dump_json(exclude_defaults=True),
                        0,
                    )
                )
                if placement is not None and evidence.category is not C.RAW:
                    copy = derive(
                        JobEvidence,
                        event,
                        key="sketch",  # the ingest run derived this event's copy already: another id, not a clash
                        source="bench",
                        jobid=placement.job_id,
                        attempt=placement.attempt,
                        node=event.node,
                        rank=rank,
                        lane=event.lane,
                        data=JobEvidenceData(evidence_id=event.id, evidence=evidence.data),
                    )
                    copies.append(encode(copy))
            await conn.executemany(
                """INSERT INTO telemetry_evidence
                       (event_id, node, kind, category, time, lane, job_id, attempt, rank, data, stream_seq)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, $11) ON CONFLICT DO NOTHING""",
                rows,
            )
            outbox = await conn.fetch(
                """INSERT INTO lanes_outbox (consumer, cause_id, subject, stream, headers, payload)
                   SELECT $1, '', s, $2, h::jsonb, p FROM unnest($3::text[], $4::text[], $5::bytea[]) AS t(s, h, p)
                   RETURNING id""",
                durable,
                JOBS.name,
                [c.subject for c in copies],
                [json.dumps(c.headers) for c in copies],
                [c.payload for c in copies],
            )
            evidence_rows = await repository.PostgresTelemetryStore(conn).evidence_of(job_id, 1, ignored=NOT_ELECTED)
            elect_first_error(evidence_rows)
        await asyncio.gather(*(publish_encoded(js, c, stream=JOBS.name) for c in copies))
        await conns.pool.execute("DELETE FROM lanes_outbox WHERE id = ANY($1::bigint[])", [r["id"] for r in outbox])
        await asyncio.gather(*(msg.ack() for msg, _ in decoded))
        done += len(msgs)
    return events / (time.perf_counter() - started)


def main() -> None:
    """Run both benchmarks and print one JSON object (medians over `--runs`)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="Fewer events, for a run under a minute.")
    parser.add_argument("--events", type=int, default=None, help="Evidence events per ingest run.")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--signed", action="store_true", help="Agents sign the evidence; the consumer verifies.")
    args = parser.parse_args()
    events = args.events or (1000 if args.quick else 4000)
    configure_logging("warning")
    election = bench_election(max(args.runs, 3))
    with servers(Settings.from_env()) as urls:
        runs = [asyncio.run(one_ingest_run(urls, events, signed=args.signed)) for _ in range(args.runs)]
    ratios = [r["ingest_per_s"] / r["raw_fetch_ack_per_s"] for r in runs]
    print(
        json.dumps(
            {
                "bench": "telemetry",
                "events_per_ingest_run": events,
                "signed": args.signed,
                "runs": runs,
                "ingest_per_s": statistics.median(r["ingest_per_s"] for r in runs),
                "raw_fetch_ack_per_s": statistics.median(r["raw_fetch_ack_per_s"] for r in runs),
                "ingest_ratio": round(statistics.median(ratios), 3),
                "batched_sketch_per_s": statistics.median(r["batched_sketch_per_s"] for r in runs),
                "batched_sketch_ratio": round(
                    statistics.median(r["batched_sketch_per_s"] / r["raw_fetch_ack_per_s"] for r in runs), 3
                ),
                **election,
            }
        )
    )


if __name__ == "__main__":
    main()
