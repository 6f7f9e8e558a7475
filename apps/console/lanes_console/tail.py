"""Following a stream live: a reader's ordered consumer that replays from the start and then tails.

The consumer is a reader's (`lanes_runtime.reader`: named in its create subject, unacknowledged, in memory,
gone once idle), so the console's NATS identity needs no right beyond `reads`. It is deleted when the
follower is closed (the browser went away), and if this process dies the server drops it after
READER_IDLE_S. A consumer lost with a server restart is made again from the first sequence not yet
yielded: the order holds, and nothing is yielded twice or skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from enum import Enum

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy

from lanes_runtime.delivery import BatchPull
from lanes_runtime.reader import reader_config, reader_name

log = structlog.get_logger(__name__)
BATCH = 256
WAIT_S = 1.0
"""How long one pull waits for a new event before it asks again (a new event ends the wait at once)."""
RETRY_S = 1.0


class Mark(Enum):
    """What `follow` yields besides messages."""

    CAUGHT_UP = "caught_up"
    """Once, after the last message that was stored when the read began (at once if there was none)."""
    IDLE = "idle"
    """After a pull that found nothing new: the reader may say it is still there (an SSE comment)."""


async def follow(
    nc: NatsClient, stream: str, subjects: tuple[str, ...], from_seq: int | None = None
) -> AsyncGenerator[Msg | Mark, None]:
    """Yield the stream's messages on `subjects` in order, from `from_seq` (default: the start), forever.

    Yields Mark.CAUGHT_UP once, after the last message stored when the read began, and Mark.IDLE after each
    pull that found nothing. Close it (`contextlib.aclosing`) to delete its consumer at once.
    """
    js = nc.jetstream()
    next_seq = from_seq
    said_caught_up = False
    while True:
        name = reader_name()
        config = reader_config(name, list(subjects))
        if next_seq is not None:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, next_seq
        pull: BatchPull | None = None
        try:
            await js.add_consumer(stream, config=config)
            pull = await BatchPull.bind(nc, stream, name)
            while True:
                msgs = await pull.fetch(BATCH, WAIT_S)
                for msg in msgs:
                    next_seq = msg.metadata.sequence.stream + 1
                    yield msg
                if not said_caught_up and (not msgs or msgs[-1].metadata.num_pending == 0):
                    said_caught_up = True
                    yield Mark.CAUGHT_UP
                elif not msgs:
                    yield Mark.IDLE
        except (NatsError, OSError, TimeoutError) as exc:
            # The stream is not there yet, the server restarted (a reader's consumer lives in its memory) or
            # is away: make the consumer again, from the first message not yielded, once it answers.
            log.warning("console follower interrupted; following again", stream=stream, error=str(exc) or repr(exc))
            await asyncio.sleep(RETRY_S)
        finally:
            if pull is not None:
                with contextlib.suppress(Exception):
                    await pull.unsubscribe()
            with contextlib.suppress(Exception):
                await asyncio.shield(js.delete_consumer(stream, name))
