"""Feeds the replica registry from the log: ordered push consumers replaying LANES_JOBS and LANES_NODES.

Each router rebuilds its registry from the start of the streams on every start (no durable state of its
own), filtered to the event types the fold reads, and then follows them live. The consumers are ephemeral
and ordered: the server replays in order, the client recreates the consumer on a gap, and nothing is left
behind when the router stops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lanes_contract.codec import decode
from lanes_contract.errors import DecodeError
from lanes_contract.events import Event
from lanes_contract.streams import JOBS, NODES

log = structlog.get_logger(__name__)
JOB_SUBJECTS = tuple(
    f"lanes.job.*.{name}"
    for name in ("submitted", "placed", "state_changed", "attempt_requested", "replica_listening", "replica_state")
)
NODE_SUBJECTS = ("lanes.node.*.state_changed",)


class RegistryFeed:
    """Replays and follows the registry's events, handing each decoded event to `apply`."""

    def __init__(self, nc: NatsClient, apply: Callable[[Event], None]) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._apply = apply
        self.caught_up = asyncio.Event()
        self.folded = 0
        self.undecodable = 0
        self._received: dict[str, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Subscribe, replay to the end of both streams (then `caught_up` is set), follow until `stop`."""
        subscriptions: list[JetStreamContext.PushSubscription] = []
        try:
            for stream, subjects in ((JOBS.name, JOB_SUBJECTS), (NODES.name, NODE_SUBJECTS)):
                config = ConsumerConfig(
                    ack_policy=AckPolicy.NONE,
                    deliver_policy=DeliverPolicy.ALL,
                    mem_storage=True,
                    filter_subjects=list(subjects),
                    inactive_threshold=30.0,
                )
                sub = await self._js.subscribe(
                    subjects[0], stream=stream, ordered_consumer=True, config=config, cb=self._on_message
                )
                subscriptions.append(sub)
            # Polls the server's consumer state: there is no local flag to wait on.
            while not await self._replayed(subscriptions):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            self.caught_up.set()
            log.info("replica registry rebuilt from the log", events=self.folded)
            await stop.wait()
        finally:
            for sub in subscriptions:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _replayed(self, subscriptions: list[JetStreamContext.PushSubscription]) -> bool:
        # Replayed when the server has nothing left to deliver and this process has folded what it sent.
        for sub in subscriptions:
            try:
                info = await sub.consumer_info()
            except TimeoutError:  # nats-py's own TimeoutError is one too
                # A busy server answers the JetStream API late: not caught up yet, ask again (a slow server
                # is no reason for a router to die at start-up).
                log.info("consumer state not answered in time; asking again")
                return False
            # Counted in this consumer's own deliveries: with a filter, the delivered *stream* sequence can
            # point past messages that were never sent (they did not match).
            delivered = (info.delivered.consumer_seq if info.delivered is not None else 0) or 0
            if info.num_pending or delivered > self._received.get(info.stream_name, 0):
                return False
        return True

    async def _on_message(self, msg: Msg) -> None:
        stream = msg.metadata.stream
        self._received[stream] = self._received.get(stream, 0) + 1
        try:
            event = decode(msg.subject, msg.headers, msg.data)
        except DecodeError as exc:
            # The consumers of record dead-letter poison; the registry only skips what it cannot read.
            self.undecodable += 1
            log.warning("skipping an undecodable event", subject=msg.subject, error=str(exc))
            return
        self.folded += 1
        self._apply(event)
