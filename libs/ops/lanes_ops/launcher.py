"""A local launcher: the node agent of `lanes demo` and `lanes up`, running each rank as a real process.

It reads placements from the job timeline, starts one OS process per rank with the usual torchrun-style
environment (RANK, WORLD_SIZE, LOCAL_RANK, LANES_JOB_ID) and publishes each rank's start and exit. Event
ids derive from the placement, so a placement redelivered after a crash publishes the same ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError

from lanes_common.bus import publish_encoded
from lanes_common.codec import decode, encode
from lanes_common.errors import DecodeError
from lanes_common.events import (
    JobPlaced,
    JobSubmitted,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    derive,
)
from lanes_common.jobs import JobSpec
from lanes_common.streams import JOBS

# What a rank runs when the spec names no command: a little real CPU work, then a clean exit.
DEFAULT_RANK_PROGRAM = (
    "import os, hashlib\n"
    "rank = int(os.environ['RANK'])\n"
    "digest = b'lanes'\n"
    "for _ in range(20000):\n"
    "    digest = hashlib.sha256(digest + bytes([rank % 256])).digest()\n"
    "print(f\"rank {rank}/{os.environ['WORLD_SIZE']} done {digest.hex()[:12]}\")\n"
)
log = structlog.get_logger(__name__)


class LocalLauncher:
    """Runs the ranks placed on a set of (simulated) nodes as local processes."""

    def __init__(self, nc: NatsClient, nodes: frozenset[str], *, durable: str = "launcher-local") -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._nodes = nodes
        self._durable = durable
        self._specs: dict[str, JobSpec] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Launch the ranks of every placement on our nodes until `stop` is set."""
        config = ConsumerConfig(
            durable_name=self._durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30,
            max_deliver=3,
            filter_subjects=["lanes.job.*.submitted", "lanes.job.*.placed"],
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
        proc = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        started = derive(RankStarted, placed, key=str(assignment.rank), data=RankStartedData(pid=proc.pid), **keys)
        await publish_encoded(self._js, encode(started), stream=JOBS.name)
        while True:
            try:
                code = await asyncio.wait_for(proc.wait(), timeout=10)
                break
            except TimeoutError:
                await msg.in_progress()  # a long rank must not make JetStream redeliver its placement
        exit_data = (
            RankExitedData(exit_code=code, signal=None) if code >= 0 else RankExitedData(exit_code=None, signal=-code)
        )
        exited = derive(RankExited, placed, key=str(assignment.rank), data=exit_data, **keys)
        await publish_encoded(self._js, encode(exited), stream=JOBS.name)
        log.info("rank finished", job_id=placed.jobid, rank=assignment.rank, node=assignment.node, exit_code=code)
