"""Feeds the replica registry from the log: a reader's pull consumers replaying LANES_JOBS and LANES_NODES.

Each router rebuilds its registry from the start of the streams on every start (no durable state of its
own), filtered to the event types the fold reads, and then follows them live (`lanes_runtime.reader.follow`: a
reader's consumer, named in its create subject, unacknowledged, in memory, gone once idle): the server
delivers in order, and a consumer lost with a server restart is made again from the next sequence this
router has not folded, so nothing is folded twice or skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lanes_contract.codec import decode
from lanes_contract.errors import DecodeError
from lanes_contract.events import Event
from lanes_contract.streams import JOBS, NODES
from lanes_runtime.reader import Mark, follow

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

    async def run(self, stop: asyncio.Event) -> None:
        """Replay both streams to their end (then `caught_up` is set), and follow them until `stop`."""
        replayed = {JOBS.name: asyncio.Event(), NODES.name: asyncio.Event()}
        followers: list[asyncio.Future[object]] = [
            asyncio.create_task(self._follow(stream, subjects, replayed[stream], stop), name=f"registry-{stream}")
            for stream, subjects in ((JOBS.name, JOB_SUBJECTS), (NODES.name, NODE_SUBJECTS))
        ]
        both: asyncio.Future[object] = asyncio.ensure_future(self._replayed(replayed))
        try:
            # A follower ends only when stopped or failed: then there is no catching up to wait for.
            await asyncio.wait([both, *followers], return_when=asyncio.FIRST_COMPLETED)
            if both.done():
                self.caught_up.set()
                log.info("replica registry rebuilt from the log", events=self.folded)
            await asyncio.gather(*followers)  # a follower's failure is the feed's
        finally:
            both.cancel()
            for follower in followers:
                follower.cancel()
            await asyncio.gather(*followers, return_exceptions=True)

    @staticmethod
    async def _replayed(replayed: dict[str, asyncio.Event]) -> object:
        return await asyncio.gather(*(event.wait() for event in replayed.values()))

    async def _follow(
        self, stream: str, subjects: tuple[str, ...], replayed: asyncio.Event, stop: asyncio.Event
    ) -> None:
        """Fold the stream's events in order until `stop`; set `replayed` once what was stored is folded."""
        async with contextlib.aclosing(follow(self._nc, stream, subjects)) as messages:
            async for item in messages:  # an idle pull yields every second: a stopping router notices
                if stop.is_set():
                    return
                if item is Mark.CAUGHT_UP:
                    replayed.set()
                elif isinstance(item, Msg):
                    self._on_message(item)

    def _on_message(self, msg: Msg) -> None:
        try:
            event = decode(msg.subject, msg.headers, msg.data)
        except DecodeError as exc:
            # The consumers of record dead-letter poison; the registry only skips what it cannot read.
            self.undecodable += 1
            log.warning("skipping an undecodable event", subject=msg.subject, error=str(exc))
            return
        self.folded += 1
        self._apply(event)
