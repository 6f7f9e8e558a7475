"""The fault checker: bounded load, faults at random, and a Jepsen-style account of what the system kept.

The stack is `lanes up --cluster 3 --replicas 2`'s shape: three embedded nats-servers routed into one cluster
(the timeline at R3, `sync_interval: always`), embedded PostgreSQL and Redis, two processes of every service,
and this process playing the local nodes' agents (the local launcher). The load, at rates set by flags:

- jobs submitted as the operator (`cli`), each run by the local launcher to its end;
- evidence storms published as an outside producer, on nodes of this run's own.

A supervisor starts again any replica that exited, as the compose stack's and Kubernetes' restart policies do
(`replica_restarts` lists each, with its exit code). Every publish that fails is sent again with the same event
id until it is acknowledged (JetStream drops a second copy), as a producer with an outbox does. Faults come every
5-10 s, in an order drawn from `--seed` (each kind once, in a shuffled order, then at random):

- `kill_replica`: SIGKILL a service replica's process; the supervisor starts it again (a restart policy);
- `pause_nats`: SIGSTOP a NATS server for 10 s;
- `kill_nats`: SIGKILL a NATS server, start it again on its port with its store;
- `pause_postgres`: SIGSTOP PostgreSQL (every process of it) for 20 s;
- `restart_redis`: SIGKILL Redis and start it again (its state is the router's hot state only);
- `partition_nats` is not run: the three servers share the loopback interface, and cutting one off needs each in
  a network namespace of its own (the output says so under `not_run`).

Then, once the load stopped and the jobs had time to finish:

- `attempted`, `acknowledged`: events this run published, and those JetStream acknowledged;
- `read_back`: per NATS server, the acknowledged events read back through a connection to that server alone;
- `lost`: acknowledged and not read back, split into prefix, middle and suffix of the publish order;
- `unexpected`: read back on this run's subjects and never attempted;
- `duplicated`: placements of one attempt published more than once;
- `stuck`: submitted jobs that never reached a terminal state (succeeded, failed, cancelled, released);
- `projections_verify`, `audit_verify`: `lanes projections rebuild --verify` and `lanes audit verify`;
- `longest_write_gap_s`: the longest time between two acknowledged publishes while faults ran.

    uv run python bench/nemesis.py --quick [--seed 7] [--jobs-per-s 1] [--evidence-per-s 40]

Prints one JSON object. Measured on a shared 2-core machine: times are what the machine gave that run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from nats.errors import Error as NatsError

from lanes_agent.launcher import LocalLauncher
from lanes_cli.bootstrap import SERVICES
from lanes_cli.demo import local_nodes, register_nodes
from lanes_cli.replicas import ReplicaEnv, ServiceReplicas
from lanes_contract.client import SIGNING_KEY_ENV, LanesClient, connect_nats
from lanes_contract.errors import LanesError
from lanes_contract.events import (
    Event,
    EvidenceCategory,
    EvidenceData,
    HostEvidence,
    JobSubmitted,
    JobSubmittedData,
)
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import JobSpec
from lanes_contract.signing import KEYRING_ENV, EventSigner
from lanes_contract.streams import JOBS, TELEMETRY
from lanes_runtime.log import configure_logging
from lanes_runtime.reader import Selection, iter_stream
from lanes_sandbox.embedded import KEYRING_FILE, EmbeddedNatsCluster, EmbeddedPostgres, EmbeddedRedis

KINDS = ("kill_replica", "pause_nats", "kill_nats", "pause_postgres", "restart_redis")
NOT_RUN = {
    "partition_nats": "the servers share the loopback interface: cutting one off needs each server in a network "
    "namespace of its own, which the embedded cluster does not do",
}
TERMINAL = {"succeeded", "failed", "cancelled", "released"}
NODES = local_nodes(2, 4)


@dataclass
class Writes:
    """What the load published: each event in publish order, whether acknowledged, and when."""

    order: list[str] = field(default_factory=list)
    acked: dict[str, float] = field(default_factory=dict)
    subjects: dict[str, str] = field(default_factory=dict)
    errors: int = 0

    async def publish(self, client: LanesClient, event: Event, stop: asyncio.Event) -> bool:
        """Publish until acknowledged (the same id each time), or until `stop`."""
        self.order.append(event.id)
        while not stop.is_set():
            try:
                await asyncio.wait_for(client.publish(event), timeout=10)
            except (TimeoutError, NatsError, LanesError, OSError):
                self.errors += 1
                await asyncio.sleep(0.2)
                continue
            self.acked[event.id] = time.monotonic()
            return True
        return False


@dataclass
class Run:
    """The stack under test."""

    cluster: EmbeddedNatsCluster
    postgres: EmbeddedPostgres
    redis: EmbeddedRedis
    replicas: ServiceReplicas
    env: dict[str, str]


def _process_tree(root: int) -> list[int]:
    """`root` and every descendant (PostgreSQL's backends), from /proc."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def _fault(run: Run, kind: str, rng: random.Random, scale: float) -> dict[str, Any]:
    """Carry out one fault and undo it; say what was done."""
    began = time.monotonic()
    target = ""
    match kind:
        case "kill_replica":
            replica = rng.choice(run.replicas.replicas)
            target = replica.name
            _signal_all([replica.pid], signal.SIGKILL)  # started again by the supervisor, as a restart policy would
        case "pause_nats":
            server = rng.choice(run.cluster.servers)
            target = server.server_name
            assert server.pid is not None  # noqa: S101 - a running server
            _signal_all([server.pid], signal.SIGSTOP)
            await asyncio.sleep(10 * scale)
            _signal_all([server.pid], signal.SIGCONT)
        case "kill_nats":
            server = rng.choice(run.cluster.servers)
            target = server.server_name
            await asyncio.to_thread(server.kill)
            await asyncio.sleep(1)
            await asyncio.to_thread(server.restart)
        case "pause_postgres":
            assert run.postgres.pid is not None  # noqa: S101 - a running server
            tree = _process_tree(run.postgres.pid)
            target = f"postgres ({len(tree)} processes)"
            _signal_all(tree, signal.SIGSTOP)
            await asyncio.sleep(20 * scale)
            _signal_all(tree, signal.SIGCONT)
        case "restart_redis":
            target = "redis"
            await asyncio.to_thread(run.redis.kill)
            await asyncio.to_thread(run.redis.restart)
        case _:
            msg = f"unknown fault kind {kind}"
            raise ValueError(msg)
    return {"kind": kind, "target": target, "lasted_s": round(time.monotonic() - began, 2)}


def schedule(seed: int, count: int) -> list[tuple[float, str]]:
    """The faults of a seed: (pause before it, kind); every kind once in a shuffled order first, then at random."""
    rng = random.Random(seed)  # noqa: S311 - a replayable schedule, not a secret
    kinds = list(KINDS)
    rng.shuffle(kinds)
    while len(kinds) < count:
        kinds.append(rng.choice(KINDS))
    return [(rng.uniform(5, 10), kind) for kind in kinds[:count]]


async def _faults(run: Run, seed: int, count: int, scale: float, done: list[dict[str, Any]]) -> None:
    rng = random.Random(seed + 1)  # noqa: S311 - targets drawn apart from the schedule, replayable
    for pause, kind in schedule(seed, count):
        await asyncio.sleep(pause * scale)
        record = await _fault(run, kind, rng, scale)
        record["at_s"] = round(time.monotonic() - START, 2)
        done.append(record)
        print(json.dumps(record), file=sys.stderr)


async def _every(rate: float, stop: asyncio.Event, act: Callable[[int], Awaitable[None]]) -> None:
    """Start `act(n)` `rate` times a second until `stop` (each runs on its own: a slow one delays none)."""
    tasks: set[asyncio.Task[None]] = set()
    n = 0
    while not stop.is_set():
        task = asyncio.ensure_future(act(n))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        n += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1 / rate)
    await asyncio.gather(*tasks)


START = time.monotonic()


async def _load_and_faults(run: Run, args: argparse.Namespace, tag: str, writes: Writes) -> list[dict[str, Any]]:
    creds = run.cluster.servers[0].credentials_dir
    operator = await LanesClient.connect(
        run.cluster.url_for("cli"), source="lanes/cli", signer=EventSigner.load(creds / "cli.key")
    )
    producer = await LanesClient.connect(
        run.cluster.url_for("producer"), source="lanes/producer", signer=EventSigner.load(creds / "producer.key")
    )
    platform_signer = EventSigner.load(creds / "platform.key")
    agents = await connect_nats(run.cluster.url_for("platform"), name="nemesis-agents", signer=platform_signer)
    stop_load, stop_agents = asyncio.Event(), asyncio.Event()
    faults: list[dict[str, Any]] = []
    try:
        await register_nodes(LanesClient(agents, "lanes/up"), NODES)
        launcher = LocalLauncher(agents, frozenset(NODES))
        running = asyncio.create_task(launcher.run(stop_agents))
        spec = JobSpec(name="nemesis", workers=1, gpus_per_worker=1)

        async def submit(n: int) -> None:
            job = f"{tag}-j{n}"
            event = JobSubmitted(source="lanes/cli", jobid=job, attempt=1, data=JobSubmittedData(spec=spec))
            writes.subjects[event.id] = job
            await writes.publish(operator, event, stop_load)

        async def evidence(n: int) -> None:
            node = f"{tag}-n{n % 4}"
            event = HostEvidence(
                id=new_event_id(),
                source="lanes/producer",
                node=node,
                data=EvidenceData(category=EvidenceCategory.RAW, lines=(f"nemesis line {n}",)),
            )
            writes.subjects[event.id] = node
            await writes.publish(producer, event, stop_load)

        load = asyncio.gather(
            _every(args.jobs_per_s, stop_load, submit), _every(args.evidence_per_s, stop_load, evidence)
        )
        supervising = asyncio.create_task(run.replicas.supervise(stop_agents))
        await _faults(run, args.seed, args.faults, args.scale, faults)
        await asyncio.sleep(3)
        stop_load.set()
        await load
        await _until_settled(run, writes, args.settle_s)
        stop_agents.set()
        await running
        await supervising
    finally:
        stop_load.set()
        stop_agents.set()
        for client in (operator, producer):
            await client.close()
        await agents.close()
    return faults


async def _job_states(database_url: str, jobs: list[str]) -> dict[str, str]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT job_id, state FROM lifecycle_jobs WHERE job_id = ANY($1)", jobs)
    finally:
        await conn.close()
    return {row["job_id"]: row["state"] for row in rows}


async def _until_settled(run: Run, writes: Writes, timeout_s: float) -> None:
    """Wait (bounded) for every acknowledged job to reach a terminal state."""
    jobs = [writes.subjects[i] for i in writes.acked if writes.subjects[i].split("-")[-1].startswith("j")]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, asyncpg.PostgresError):
            states = await _job_states(run.postgres.url, jobs)
            if len(states) == len(jobs) and all(state in TERMINAL for state in states.values()):
                return
        await asyncio.sleep(1)


async def _quiet(run: Run, timeout_s: float) -> bool:
    """Wait (bounded) until the services are idle: what they show is then what the log says.

    Idle: every service consumer has nothing pending or unacknowledged, no staged event waits to be folded and
    no outbox row to be published.
    """
    durables = [(spec.stream.name, spec.durable) for service in SERVICES.values() for spec, _ in service.consumers]
    nc = await connect_nats(run.cluster.url, name="nemesis-quiet")
    deadline = time.monotonic() + timeout_s
    try:
        js = nc.jetstream(timeout=5)
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                infos = [await js.consumer_info(stream, durable) for stream, durable in durables]
                conn = await asyncpg.connect(run.postgres.url)
                try:
                    staged = await conn.fetchval(
                        "SELECT (SELECT count(*) FROM lanes_inbox) + (SELECT count(*) FROM lanes_outbox)"
                    )
                finally:
                    await conn.close()
                if not staged and all(not i.num_pending and not i.num_ack_pending for i in infos):
                    return True
            await asyncio.sleep(1)
    finally:
        await nc.close()
    return False


async def _read_back(url: str, tag: str) -> tuple[list[str], dict[tuple[str, int], int]]:
    """This run's events as one server serves them, and the placements per (job, attempt)."""
    nc = await connect_nats(url, name="nemesis-check")
    ids: list[str] = []
    placements: dict[tuple[str, int], int] = {}
    try:
        js = nc.jetstream()
        for stream, subject, key in (
            (JOBS.name, "lanes.job.*.submitted", "ce-jobid"),
            (TELEMETRY.name, "lanes.tel.>", "ce-node"),
        ):
            async for msg in iter_stream(js, Selection(stream, subject)):
                headers = msg.headers or {}
                if headers.get(key, "").startswith(f"{tag}-"):
                    ids.append(headers.get("ce-id", ""))
        async for msg in iter_stream(js, Selection(JOBS.name, "lanes.job.*.placed")):
            headers = msg.headers or {}
            job = headers.get("ce-jobid", "")
            if job.startswith(f"{tag}-"):
                attempt = (job, int(headers.get("ce-attempt", "0")))
                placements[attempt] = placements.get(attempt, 0) + 1
    finally:
        await nc.close()
    return ids, placements


def _lost_split(order: list[str], acked: set[str], read: set[str]) -> dict[str, int]:
    """Acknowledged and not read, split by where they sit in the publish order among the acknowledged."""
    sequence = [i for i in order if i in acked]
    present = [n for n, i in enumerate(sequence) if i in read]
    first, last = (present[0], present[-1]) if present else (len(sequence), -1)
    split = {"prefix": 0, "middle": 0, "suffix": 0}
    for n, i in enumerate(sequence):
        if i in read:
            continue
        split["prefix" if n < first else "suffix" if n > last else "middle"] += 1
    return {"total": sum(split.values()), **split}


def _lanes(env: dict[str, str], *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", "from lanes_cli.cli import main; main()", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    said = done.stdout.strip()
    with contextlib.suppress(ValueError):
        return {"exit": done.returncode, "said": json.loads(said)}
    return {"exit": done.returncode, "said": (said + "\n" + done.stderr).strip().splitlines()[-5:]}


async def check(run: Run, writes: Writes, tag: str, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """The Jepsen-style account."""
    acked = set(writes.acked)
    attempted = set(writes.order)
    read_back: dict[str, int] = {}
    lost: dict[str, dict[str, int]] = {}
    unexpected: set[str] = set()
    duplicated = 0
    for server in run.cluster.servers:
        ids, placements = await _read_back(server.url, tag)
        read = set(ids)
        read_back[server.server_name] = len(read & acked)
        lost[server.server_name] = _lost_split(writes.order, acked, read)
        unexpected |= read - attempted
        duplicated = max(duplicated, sum(count - 1 for count in placements.values() if count > 1))
    jobs = sorted({writes.subjects[i] for i in acked if writes.subjects[i].split("-")[-1].startswith("j")})
    states = await _job_states(run.postgres.url, jobs)
    stuck = sorted(job for job in jobs if states.get(job) not in TERMINAL)
    times = sorted(writes.acked.values())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    quiet = await _quiet(run, 60)
    projections = await asyncio.to_thread(_lanes, run.env, "projections", "rebuild", "--verify")
    audit = await asyncio.to_thread(_lanes, run.env, "audit", "verify")
    worst_lost = max((v["total"] for v in lost.values()), default=0)
    return {
        "attempted": len(attempted),
        "acknowledged": len(acked),
        "publish_retries": writes.errors,
        "read_back": read_back,
        "lost": {"total": worst_lost, "per_server": lost},
        "unexpected": len(unexpected),
        "duplicated": duplicated,
        "jobs": len(jobs),
        "stuck": len(stuck),
        "stuck_jobs": {job: states.get(job, "never seen") for job in stuck[:20]},
        "quiet_before_verify": quiet,
        "projections_verify": projections,
        "audit_verify": audit,
        "longest_write_gap_s": round(max(gaps, default=0.0), 2),
        "replica_restarts": [f"{name} (exit {code})" for name, code in run.replicas.restarts],
        "fault_kinds": sorted({f["kind"] for f in faults}),
        "faults": faults,
    }


def _start(stack: contextlib.ExitStack, replicas: int, work: Path, logs: Path, settle_window_s: float) -> Run:
    cluster = stack.enter_context(EmbeddedNatsCluster(3, work))
    postgres = stack.enter_context(EmbeddedPostgres(work))
    redis = stack.enter_context(EmbeddedRedis(work))
    creds = cluster.servers[0].credentials_dir
    group = ServiceReplicas(
        SERVICES,
        replicas,
        ReplicaEnv(cluster.url_for, postgres.url, redis.url, 3, creds, {"LANES_SETTLE_WINDOW_S": str(settle_window_s)}),
        logs,
    )
    env = dict(os.environ) | {
        "NATS_URL": cluster.url_for("cli"),
        "DATABASE_URL": postgres.url,
        "REDIS_URL": redis.url,
        "LANES_STREAM_REPLICAS": "3",
        SIGNING_KEY_ENV: str(creds / "cli.key"),
        KEYRING_ENV: str(creds / KEYRING_FILE),
        "LANES_LOG_FORMAT": "json",
    }
    return Run(cluster, postgres, redis, group, env)


def main() -> None:
    """Run the checker and print its JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="each fault kind once (5 faults), short settle")
    parser.add_argument("--seed", type=int, default=None, help="replays a fault schedule (default: random)")
    parser.add_argument("--faults", type=int, default=10, help="faults to inject (--quick: 5)")
    parser.add_argument("--jobs-per-s", type=float, default=1.0, help="job submissions per second")
    parser.add_argument("--evidence-per-s", type=float, default=40.0, help="evidence events per second")
    parser.add_argument("--logs", type=Path, default=None, help="keep the service replicas' logs in this directory")
    parser.add_argument("--replicas", type=int, default=2, help="processes of each service")
    parser.add_argument("--settle-s", type=float, default=120.0, help="how long jobs may take to finish after")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="times the 5-10 s between faults and the 10 s and 20 s pauses"
    )
    args = parser.parse_args()
    configure_logging("warning")  # to stderr: stdout is the JSON
    if args.quick:
        args.faults = len(KINDS)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    tag = f"nm{uuid.uuid4().hex[:6]}"
    work = Path(tempfile.mkdtemp(prefix="lanes-nemesis-"))
    work.chmod(0o755)  # PostgreSQL's unprivileged user passes through
    writes = Writes()
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        logs = args.logs or work / "replicas"
        run = _start(stack, args.replicas, work, logs, settle_window_s=5.0)
        with run.replicas.running(keep_logs=args.logs is not None):
            faults = asyncio.run(_load_and_faults(run, args, tag, writes))
            result = asyncio.run(check(run, writes, tag, faults))
    print(
        json.dumps(
            {
                "bench": "nemesis",
                "seed": args.seed,
                "schedule": [kind for _, kind in schedule(args.seed, args.faults)],
                "not_run": NOT_RUN,
                "duration_s": round(time.monotonic() - began, 1),
                "load": {"jobs_per_s": args.jobs_per_s, "evidence_per_s": args.evidence_per_s},
                "replicas": args.replicas,
                "nats": "3 servers, streams R3, sync_interval always",
                **result,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
