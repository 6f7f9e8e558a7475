"""Telemetry ingest and lifecycle events/s with 1 and with 2 processes of each, on a 3-server NATS cluster.

For each replica count, a fresh stack (three nats-servers, the streams at R3 with `sync_interval: always`,
PostgreSQL, Redis) runs that many `lanes serve telemetry` and `lanes serve lifecycle` processes. They are
stopped (SIGSTOP) while the load is published, so what is timed is their draining of it, not the publish:

- `ingest_per_s`: raw evidence events (on nodes of the run's own) through telemetry's `telemetry` durable;
- `lifecycle_per_s`: job submissions through the lifecycle's `lifecycle-jobs` durable (each job queued);
- `raw_per_s`: the same evidence fetched and acknowledged with nats-py alone, on the same cluster, in the run;
- `publish_per_s`: the evidence's publish (batches of 256 acknowledgements awaited together) at R3 with every
  write fsynced: the rate `sync_interval: always` allows here.

`scaling_2_vs_1` is the 2-process rate over the 1-process rate. Telemetry's durables have a pinned client (one
replica works at a time, the other stands by), so its ratio is about 1 by design.

    uv run python bench/replicas.py [--evidence 10000] [--jobs 1000] [--runs 1]

Prints one JSON object (medians over runs). Measured on a shared 2-core machine: rates are what it gave.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import ServiceUnavailableError

from lanes_cli.replicas import ReplicaEnv, ServiceReplicas
from lanes_contract.client import LanesClient
from lanes_contract.events import Event, EvidenceCategory, EvidenceData, HostEvidence, JobSubmitted, JobSubmittedData
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import JobSpec
from lanes_contract.signing import EventSigner
from lanes_contract.streams import JOBS, TELEMETRY
from lanes_runtime.log import configure_logging
from lanes_sandbox.embedded import EmbeddedNatsCluster, EmbeddedPostgres, EmbeddedRedis

_CHUNK = 256


async def _publish(client: LanesClient, events: Sequence[Event]) -> float:
    began = time.perf_counter()
    for start in range(0, len(events), _CHUNK):
        await asyncio.gather(*(client.publish(e) for e in events[start : start + _CHUNK]))
    return time.perf_counter() - began


async def _drained(js: JetStreamContext, stream: str, durable: str, last_seq: int) -> float:
    """When (perf_counter) the durable had acknowledged everything up to the stream sequence `last_seq`."""
    while True:
        with contextlib.suppress(Exception):
            info = await js.consumer_info(stream, durable)
            acked = int(info.ack_floor.stream_seq) if info.ack_floor else 0
            if not info.num_ack_pending and acked >= last_seq:
                return time.perf_counter()
        await asyncio.sleep(0.1)


async def _raw(js: JetStreamContext, subject: str, count: int) -> float:
    durable = f"raw-{uuid.uuid4().hex[:6]}"
    config = ConsumerConfig(
        durable_name=durable,
        filter_subject=subject,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        max_ack_pending=1024,
    )
    await js.add_consumer(TELEMETRY.name, config=config)
    sub = await js.pull_subscribe_bind(durable, stream=TELEMETRY.name)
    began = time.perf_counter()
    seen = 0
    while seen < count:
        try:
            msgs = await sub.fetch(256, timeout=10)
        except (ServiceUnavailableError, TimeoutError):
            continue  # a fresh R3 consumer answers once its leader is elected
        for msg in msgs:
            await msg.ack()
            seen += 1
    elapsed = time.perf_counter() - began
    await js.delete_consumer(TELEMETRY.name, durable)
    return elapsed


async def _measure(cluster: EmbeddedNatsCluster, group: ServiceReplicas, evidence: int, jobs: int) -> dict[str, float]:
    creds = cluster.servers[0].credentials_dir
    tag = f"rp{uuid.uuid4().hex[:6]}"
    producer = await LanesClient.connect(
        cluster.url_for("producer"), source="lanes/producer", signer=EventSigner.load(creds / "producer.key")
    )
    operator = await LanesClient.connect(
        cluster.url_for("cli"), source="lanes/cli", signer=EventSigner.load(creds / "cli.key")
    )
    admin = await LanesClient.connect(cluster.url, source="bench")
    try:
        # Ready: both durables exist (each replica made or found them).
        while True:
            with contextlib.suppress(Exception):
                await admin.js.consumer_info(TELEMETRY.name, "telemetry")
                await admin.js.consumer_info(JOBS.name, "lifecycle-jobs")
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)
        for replica in group.replicas:
            os.kill(replica.pid, signal.SIGSTOP)
        lines: list[Event] = [
            HostEvidence(
                id=new_event_id(),
                source="lanes/producer",
                node=f"{tag}-n{n % 8}",
                data=EvidenceData(category=EvidenceCategory.RAW, lines=(f"line {n}",)),
            )
            for n in range(evidence)
        ]
        spec = JobSpec(name="bench", workers=1, gpus_per_worker=1)
        submissions: list[Event] = [
            JobSubmitted(source="lanes/cli", jobid=f"{tag}-j{n}", attempt=1, data=JobSubmittedData(spec=spec))
            for n in range(jobs)
        ]
        publish_s = await _publish(producer, lines)
        await _publish(operator, submissions)
        evidence_last = (await admin.js.stream_info(TELEMETRY.name)).state.last_seq
        jobs_last = (await admin.js.stream_info(JOBS.name)).state.last_seq
        began = time.perf_counter()
        for replica in group.replicas:
            os.kill(replica.pid, signal.SIGCONT)
        # Both drain at once (as they would in production), each timed to its own end.
        ingest_end, lifecycle_end = await asyncio.gather(
            _drained(admin.js, TELEMETRY.name, "telemetry", evidence_last),
            _drained(admin.js, JOBS.name, "lifecycle-jobs", jobs_last),
        )
        ingest_s, lifecycle_s = ingest_end - began, lifecycle_end - began
        raw_s = await _raw(admin.js, "lanes.tel.>", evidence)  # only this run's evidence is in the stream
    finally:
        for client in (producer, operator, admin):
            await client.close()
    return {
        "ingest_per_s": evidence / ingest_s,
        "lifecycle_per_s": jobs / lifecycle_s,
        "raw_per_s": evidence / raw_s,
        "publish_per_s": evidence / publish_s,
    }


def _one(replicas: int, evidence: int, jobs: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="lanes-bench-replicas-"))
    work.chmod(0o755)  # PostgreSQL's unprivileged user passes through
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        cluster = stack.enter_context(EmbeddedNatsCluster(3, work))
        postgres = stack.enter_context(EmbeddedPostgres(work))
        redis = stack.enter_context(EmbeddedRedis(work))
        creds = cluster.servers[0].credentials_dir
        group = ServiceReplicas(
            ["telemetry", "lifecycle"],
            replicas,
            ReplicaEnv(cluster.url_for, postgres.url, redis.url, 3, creds, {}),
            work / "replicas",
        )
        with group.running():
            return asyncio.run(_measure(cluster, group, evidence, jobs))


def main() -> None:
    """Measure with 1 and with 2 processes; print JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--evidence", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=1_000)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    configure_logging("warning")
    results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for _ in range(args.runs):
        for count in (1, 2):  # alternating, so the machine's load falls on both alike
            results[count].append(_one(count, args.evidence, args.jobs))
    medians = {
        count: {key: statistics.median(run[key] for run in runs) for key in runs[0]} for count, runs in results.items()
    }
    out: dict[str, object] = {"bench": "replicas", "runs": args.runs, "evidence": args.evidence, "jobs": args.jobs}
    for count, figures in medians.items():
        shown = {key: round(value, 1) for key, value in figures.items()}
        shown["ingest_ratio_to_raw"] = round(figures["ingest_per_s"] / figures["raw_per_s"], 3)
        out[f"replicas_{count}"] = shown
    out["scaling_2_vs_1"] = {
        "ingest": round(medians[2]["ingest_per_s"] / medians[1]["ingest_per_s"], 2),
        "lifecycle": round(medians[2]["lifecycle_per_s"] / medians[1]["lifecycle_per_s"], 2),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
