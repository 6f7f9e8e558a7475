"""A local launcher: the node agent of `lanes demo` and `lanes up`, running each rank as a real process.

It reads placements from the job timeline, starts one OS process per rank with the usual torchrun-style
environment (RANK, WORLD_SIZE, LOCAL_RANK, LANES_JOB_ID) and publishes each rank's start, rendezvous,
communicator readiness (the rank prints READY_MARKER) and exit. It terminates an attempt's ranks when
the lifecycle cancels it or declares it partially failed. Event ids derive from the placement, so a
placement redelivered after a crash publishes the same ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from typing import Any

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError

from lanes_common.bus import publish_encoded
from lanes_common.codec import decode, encode
from lanes_common.errors import DecodeError
from lanes_common.events import (
    CommunicatorReady,
    CommunicatorReadyData,
    EvidenceCategory,
    JobPlaced,
    JobStateChanged,
    JobSubmitted,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    RendezvousDone,
    RendezvousDoneData,
    derive,
    utc_now,
)
from lanes_common.ids import derived_event_id
from lanes_common.jobs import JobSpec, JobState
from lanes_common.streams import JOBS, TELEMETRY
from lanes_telemetry.domain.evidence import Evidence, evidence_event
from lanes_telemetry.domain.parsers import LogParser, SourceContext

READY_MARKER = "lanes: communicator ready"
"""A rank prints this line once its collective communicator is initialised; the launcher reports it."""
# What a rank runs when the spec names no command: ready at once, a little real CPU work, a clean exit.
DEFAULT_RANK_PROGRAM = (
    "import os, hashlib\n"
    f"print({READY_MARKER!r}, flush=True)\n"
    "rank = int(os.environ['RANK'])\n"
    "digest = b'lanes'\n"
    "for _ in range(20000):\n"
    "    digest = hashlib.sha256(digest + bytes([rank % 256])).digest()\n"
    "print(f\"rank {rank}/{os.environ['WORLD_SIZE']} done {digest.hex()[:12]}\")\n"
)
_STOP_RANKS = frozenset({JobState.CANCELLING, JobState.CANCELLED, JobState.PARTIALLY_FAILED, JobState.FAILED})
"""States in which the launcher terminates the attempt's ranks (and starts none of those not yet started):
cancelled, or (like torchrun's elastic agent) a rank failed, so the rest of the gang is torn down."""
log = structlog.get_logger(__name__)


class LocalLauncher:
    """Runs the ranks placed on a set of (simulated) nodes as local processes."""

    def __init__(self, nc: NatsClient, nodes: frozenset[str], *, durable: str = "launcher-local") -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._nodes = nodes
        self._durable = durable
        self._specs: dict[str, JobSpec] = {}
        self._procs: dict[tuple[str, int], set[asyncio.subprocess.Process]] = {}
        self._stopping: set[tuple[str, int]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Launch the ranks of every placement on our nodes until `stop` is set."""
        config = ConsumerConfig(
            durable_name=self._durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30,
            max_deliver=3,
            filter_subjects=["lanes.job.*.submitted", "lanes.job.*.placed", "lanes.job.*.state_changed"],
        )
        with contextlib.suppress(APIError):
            await self._js.add_consumer(JOBS.name, config=config)
        sub = await self._js.pull_subscribe_bind(self._durable, stream=JOBS.name)
        running: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(16, timeout=0.5)
                except TimeoutError:  # nats-py raises its own subclass or the builtin, depending on the path
                    continue
                for msg in msgs:
                    task = asyncio.create_task(self._handle(msg))
                    running.add(task)
                    task.add_done_callback(running.discard)
        finally:
            for attempt_key in list(self._procs):
                self._stop_attempt(attempt_key)  # no rank outlives its launcher
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _handle(self, msg: Msg) -> None:
        try:
            event = decode(msg.subject, msg.headers, msg.data)
        except DecodeError as exc:
            # Not ours to dead-letter: the services' consumers see the same message and dead-letter it.
            log.warning("launcher skips an undecodable message", error=str(exc))
            await msg.ack()
            return
        if isinstance(event, JobSubmitted):
            self._specs[str(event.jobid)] = event.data.spec
        elif isinstance(event, JobStateChanged) and event.data.to_state in _STOP_RANKS:
            self._stop_attempt((str(event.jobid), event.attempt or 1))
        elif isinstance(event, JobPlaced):
            mine = [a for a in event.data.assignments if a.node in self._nodes]
            spec = self._specs.get(str(event.jobid))
            if mine and spec is not None:
                world = len(event.data.assignments)
                await asyncio.gather(*(self._run_rank(event, spec, a, world, msg) for a in mine))
        await msg.ack()

    async def _run_rank(
        self, placed: JobPlaced, spec: JobSpec, assignment: RankAssignment, world: int, msg: Msg
    ) -> None:
        command = list(spec.command) or [sys.executable, "-c", DEFAULT_RANK_PROGRAM]
        local_rank = [a.rank for a in placed.data.assignments if a.node == assignment.node].index(assignment.rank)
        env = os.environ | {
            "RANK": str(assignment.rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank),
            "LANES_JOB_ID": str(placed.jobid),
            "LANES_ATTEMPT": str(placed.attempt or 1),
            "LANES_NODE": assignment.node,
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, assignment.gpus)),
        }
        keys = {"source": f"agent/{assignment.node}", "node": assignment.node, "rank": assignment.rank}
        attempt_key = (str(placed.jobid), placed.attempt or 1)
        if attempt_key in self._stopping:
            return  # cancelled before this rank was started: never start it
        proc = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        self._procs.setdefault(attempt_key, set()).add(proc)
        if attempt_key in self._stopping:  # stopped while this process was being spawned
            proc.terminate()
        rank_key = str(assignment.rank)
        started = derive(RankStarted, placed, key=rank_key, data=RankStartedData(pid=proc.pid), **keys)
        await publish_encoded(self._js, encode(started), stream=JOBS.name)
        # The local launcher's rendezvous is static: RANK and WORLD_SIZE are known when the process starts.
        met = derive(RendezvousDone, placed, key=rank_key, data=RendezvousDoneData(world_size=world), **keys)
        await publish_encoded(self._js, encode(met), stream=JOBS.name)
        reader = asyncio.create_task(self._watch_output(proc, placed, assignment, keys))
        while True:
            try:
                code = await asyncio.wait_for(proc.wait(), timeout=10)
                break
            except TimeoutError:
                await msg.in_progress()  # a long rank must not make JetStream redeliver its placement
        await reader  # its events come before the exit, as they happened
        self._procs[attempt_key].discard(proc)
        exit_data = (
            RankExitedData(exit_code=code, signal=None) if code >= 0 else RankExitedData(exit_code=None, signal=-code)
        )
        exited = derive(RankExited, placed, key=str(assignment.rank), data=exit_data, **keys)
        await publish_encoded(self._js, encode(exited), stream=JOBS.name)
        log.info("rank finished", job_id=placed.jobid, rank=assignment.rank, node=assignment.node, exit_code=code)

    async def _watch_output(
        self, proc: asyncio.subprocess.Process, placed: JobPlaced, assignment: RankAssignment, keys: dict[str, Any]
    ) -> None:
        """Tail the rank's output as a node agent tails logs: the ready marker, and evidence for telemetry."""
        assert proc.stdout is not None  # noqa: S101 - the process is always started with pipes
        assert proc.stderr is not None  # noqa: S101
        rank_key = str(assignment.rank)
        context = SourceContext(
            origin=f"{placed.jobid}/rank{assignment.rank}", node=assignment.node, rank=assignment.rank
        )
        parser = LogParser(context)
        lines = 0

        async def report(found: list[Evidence]) -> None:
            nonlocal lines
            for evidence in found:
                lines += 1
                if evidence.category is EvidenceCategory.RAW:
                    continue  # plain output is not evidence; keep the telemetry stream for what is
                event = evidence_event(evidence, source=keys["source"], node=assignment.node, time=utc_now())
                event = event.model_copy(update={"id": derived_event_id(placed.id, event.type, f"{rank_key}:{lines}")})
                await publish_encoded(self._js, encode(event), stream=TELEMETRY.name)

        async def follow(stream: asyncio.StreamReader, *, watch_ready: bool) -> None:
            reported = False
            async for raw in stream:
                line = raw.decode(errors="replace")
                if watch_ready and not reported and line.strip() == READY_MARKER:
                    ready = derive(CommunicatorReady, placed, key=rank_key, data=CommunicatorReadyData(), **keys)
                    await publish_encoded(self._js, encode(ready), stream=JOBS.name)
                    reported = True
                    continue
                await report(parser.feed(line))

        await asyncio.gather(follow(proc.stdout, watch_ready=True), follow(proc.stderr, watch_ready=False))
        await report(parser.finish())

    def _stop_attempt(self, attempt_key: tuple[str, int]) -> None:
        """Terminate the ranks of a cancelled attempt; their exits (signal 15) end the cancellation."""
        self._stopping.add(attempt_key)
        for proc in self._procs.get(attempt_key, set()):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
