"""Feeds the replica registry from the log: a reader's pull consumers replaying LANES_JOBS and LANES_NODES.

Each router rebuilds its registry from the start of the streams on every start (no durable state of its
own), filtered to the event types the fold reads, and then follows them live. The consumers are a reader's
(`lanes_runtime.reader`: named in their create subject, unacknowledged, in memory, gone once idle): the
server delivers in order, and a consumer lost with a server restart is made again from the next sequence
this router has not folded, so nothing is folded twice or skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy

from lanes_contract.codec import decode
from lanes_contract.errors import DecodeError
from lanes_contract.events import Event
from lanes_contract.streams import JOBS, NODES
from lanes_runtime.delivery import BatchPull
from lanes_runtime.reader import reader_config, reader_name

log = structlog.get_logger(__name__)
JOB_SUBJECTS = tuple(
    f"lanes.job.*.{name}"
    for name in ("submitted", "placed", "state_changed", "attempt_requested", "replica_listening", "replica_state")
)
NODE_SUBJECTS = ("lanes.node.*.state_changed",)
_BATCH = 256
_WAIT_S = 1.0
"""How long one pull waits for a new event: also how soon a stopping router notices."""
_RETRY_S = 1.0


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
        """Pull the stream's events in order until `stop`; set `replayed` once a pull finds nothing newer."""
        next_seq: int | None = None
        """The first sequence not folded yet (None: nothing folded, start at the start of the stream)."""
        while not stop.is_set():
            name = reader_name()
            config = reader_config(name, list(subjects))
            if next_seq is not None:
                config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, next_seq
            pull: BatchPull | None = None
            try:
                await self._js.add_consumer(stream, config=config)
                pull = await BatchPull.bind(self._nc, stream, name)
                while not stop.is_set():
                    msgs = await pull.fetch(_BATCH, _WAIT_S)
                    for msg in msgs:
                        self._on_message(msg)
                        next_seq = msg.metadata.sequence.stream + 1
                    if not msgs or msgs[-1].metadata.num_pending == 0:
                        replayed.set()
            except (NatsError, OSError, TimeoutError) as exc:
                # The server restarted (a reader's consumer lives in its memory) or is away: make it again,
                # from the first event not folded, once the server answers.
                log.warning("registry feed interrupted; following again", stream=stream, error=str(exc) or repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=_RETRY_S)
            finally:
                if pull is not None:
                    with contextlib.suppress(Exception):
                        await pull.unsubscribe()
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._js.delete_consumer(stream, name))

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
