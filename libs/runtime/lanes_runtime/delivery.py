"""What every message loop of Lanes shares: fetching, holding through an outage, and carrying out a decision.

Three loops read JetStream: the services' transactional batch consumer (`consumer.py`), the node agent (a
placement is held for as long as its ranks run) and the audit recorder (a chain that must never skip).
They differ in what they do with a batch, not in how they take it or give it back, and that part lives
here once:

- `pull_batches`: fetch from a durable pull consumer until stopped; a fetch that fails because the bus is
  away took nothing, so it is tried again after a pause.
- `hold_through_outages`: run an attempt until no server is unavailable, keeping the held messages in
  progress (their ack timers restart) and spending no delivery, with `decide`'s backoff.
- `carry_out`: ack, nak or dead-letter-then-term, as `decide` said. A message is terminated only once its
  dead letter is stored; if that fails it is sent back instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, TypeVar

import structlog
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from lanes_contract.codec import MSG_ID_HEADER
from lanes_contract.streams import DEAD
from lanes_runtime import decision
from lanes_runtime.failures import is_infrastructure

if TYPE_CHECKING:
    from lanes_runtime.consumer import ConsumerSpec

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

DEAD_REASON = "Lanes-Dead-Reason"
DEAD_STREAM = "Lanes-Dead-Stream"
DEAD_SEQUENCE = "Lanes-Dead-Sequence"
DEAD_SUBJECT = "Lanes-Dead-Subject"
DEAD_CONSUMER = "Lanes-Dead-Consumer"
DEAD_DELIVERIES = "Lanes-Dead-Deliveries"
ORIGINAL_MSG_ID = "Lanes-Original-Msg-Id"

FETCH_WAIT_S = 0.5
"""How long one fetch waits for messages before the loop looks at its stop signal again."""
REFETCH_AFTER_S = 1.0
"""The pause after a fetch failed because the bus was away (nothing was taken, so nothing is lost)."""


class Settled(StrEnum):
    """What `carry_out` did with a message."""

    ACKED = "acked"
    SENT_BACK = "sent_back"
    DEAD_LETTERED = "dead_lettered"


class InProgress(Protocol):
    """A message whose ack timer can be restarted (a fetched JetStream message)."""

    async def in_progress(self) -> None:
        """Tell the server the message is still being worked on."""


class StoppedError(Exception):
    """The loop was stopped while holding messages through an outage; they come back after ack_wait."""


@dataclass(frozen=True)
class DeadLetter:
    """Where a dead message came from, and why it died."""

    stream: str
    consumer: str
    subject: str
    stream_seq: int
    deliveries: int
    reason: str

    @classmethod
    def of(cls, msg: Msg, consumer: str, reason: str) -> DeadLetter:
        """The letter for a fetched message."""
        meta = msg.metadata
        return cls(meta.stream, consumer, msg.subject, int(meta.sequence.stream), meta.num_delivered, reason)


async def dead_letter(
    js: JetStreamContext, letter: DeadLetter, headers: Mapping[str, str] | None, payload: bytes
) -> None:
    """Publish a message to LANES_DEAD with its original headers and payload and where and why it died.

    Its id is one per (stream, sequence, consumer), so dead-lettering twice keeps one letter, and
    `lanes dead replay` can re-drive it under its original id.
    """
    original = dict(headers or {})
    dead_headers = {k: v for k, v in original.items() if not k.startswith("Nats-")}
    if MSG_ID_HEADER in original:
        dead_headers[ORIGINAL_MSG_ID] = original[MSG_ID_HEADER]
    dead_headers |= {
        DEAD_REASON: " ".join(letter.reason.split())[:1024],  # header values are single-line
        DEAD_STREAM: letter.stream,
        DEAD_SEQUENCE: str(letter.stream_seq),
        DEAD_SUBJECT: letter.subject,
        DEAD_CONSUMER: letter.consumer,
        DEAD_DELIVERIES: str(letter.deliveries),
        MSG_ID_HEADER: f"dead-{letter.stream}-{letter.stream_seq}-{letter.consumer}",
    }
    await js.publish(f"lanes.dead.{letter.stream}.{letter.consumer}", payload, headers=dead_headers, stream=DEAD.name)


class InHand:
    """The messages a loop has fetched and not yet settled: what it keeps in progress through an outage."""

    def __init__(self) -> None:
        self._msgs: dict[str, Msg] = {}  # by reply subject: one per delivery

    def add(self, msgs: Iterable[Msg]) -> None:
        """Fetched messages, now in hand."""
        for msg in msgs:
            self._msgs[msg.reply] = msg

    def discard(self, msg: Msg) -> None:
        """A message acked, sent back or terminated: no longer this loop's to keep."""
        self._msgs.pop(msg.reply, None)

    def __iter__(self) -> Iterator[Msg]:
        return iter(self._msgs.values())


async def pull_batches(
    sub: JetStreamContext.PullSubscription,
    size: int,
    stop: asyncio.Event,
    *,
    consumer: str,
    on_unavailable: Callable[[], None] | None = None,
    in_hand: InHand | None = None,
) -> AsyncIterator[list[Msg]]:
    """Yield fetched batches until `stop` is set; an empty list when a fetch waited and found nothing.

    With `in_hand`, the next batch is fetched while the caller works on the one yielded, so the fetch's round
    trip overlaps that work. Every fetched message goes into `in_hand` as it arrives: a caller holding a batch
    through an outage keeps the batch ahead in progress too, which would otherwise time out and come back,
    spending a delivery on nothing. Once `stop` is set, the batch already fetched ahead is still yielded.
    """

    async def fetch() -> list[Msg]:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(size, timeout=FETCH_WAIT_S)
            except TimeoutError:  # nats-py raises its own subclass or the builtin, depending on the path
                return []
            except NatsError as exc:
                # Disconnected or reconnecting: nothing was taken, so nothing is lost; try again shortly.
                log.warning("fetch failed; retrying", consumer=consumer, error=str(exc) or type(exc).__name__)
                if on_unavailable is not None:
                    on_unavailable()
                await asyncio.sleep(REFETCH_AFTER_S)
                continue
            if in_hand is not None:
                in_hand.add(msgs)
            return msgs
        return []

    if in_hand is None:
        while not stop.is_set():
            yield await fetch()
        return
    ahead: asyncio.Future[list[Msg]] | None = asyncio.ensure_future(fetch())
    try:
        while ahead is not None:
            msgs = await ahead
            ahead = None if stop.is_set() else asyncio.ensure_future(fetch())
            yield msgs
    finally:
        if ahead is not None:
            # Closed early: a message this fetch still takes comes back after its ack wait.
            ahead.cancel()


async def hold_through_outages(
    attempt: Callable[[], Awaitable[_T]],
    spec: ConsumerSpec,
    *,
    held: Iterable[InProgress] = (),
    stop: asyncio.Event | None = None,
    on_hold: Callable[[Exception, float], None] | None = None,
) -> _T:
    """Run `attempt` until no server is unavailable, pausing with `decide`'s backoff between tries.

    Any other failure is raised to the caller, which decides about the message. Raises StoppedError when
    `stop` is set during a pause.
    """
    outages = 0
    while True:
        try:
            return await attempt()
        except Exception as exc:
            if not is_infrastructure(exc):
                raise
            outages += 1
            hold = decision.decide(decision.Unavailable(str(exc), outages), 0, spec)
            assert isinstance(hold, decision.Hold)  # noqa: S101 - decide's rule for Unavailable
            log.warning(
                "server unavailable; holding",
                consumer=spec.durable,
                error=f"{type(exc).__name__}: {exc}",
                pause_s=hold.delay_s,
            )
            if on_hold is not None:
                on_hold(exc, hold.delay_s)
            await keep_in_progress(held, hold.delay_s, spec.ack_wait_s, stop)


async def keep_in_progress(
    held: Iterable[InProgress], delay_s: float, ack_wait_s: float, stop: asyncio.Event | None = None
) -> None:
    """Wait `delay_s`, telling JetStream every so often that the held messages are still being worked on.

    `held` is read again at every turn, so a live collection (`InHand`) covers messages fetched meanwhile.
    """
    deadline = time.monotonic() + delay_s
    while (left := deadline - time.monotonic()) > 0:
        for msg in tuple(held):
            await settle(msg.in_progress())
        if stop is not None and stop.is_set():
            raise StoppedError
        await asyncio.sleep(min(left, ack_wait_s / 3))


async def carry_out(js: JetStreamContext, msg: Msg, verdict: decision.Decision, spec: ConsumerSpec) -> Settled:
    """Ack, nak or dead-letter `msg` as `verdict` says (a Hold is the caller's to carry out)."""
    match verdict:
        case decision.Ack():
            await settle(msg.ack())
            return Settled.ACKED
        case decision.Nak(delay_s):
            await settle(msg.nak(delay=delay_s))
            return Settled.SENT_BACK
        case decision.Term(reason):
            letter = DeadLetter.of(msg, spec.durable, reason)
            log.error("dead-lettering", consumer=spec.durable, reason=reason, seq=letter.stream_seq)
            try:
                await dead_letter(js, letter, msg.headers, msg.data)
            except Exception as exc:  # noqa: BLE001 - without a dead letter the message must not be terminated
                # Send it back instead. Past max_deliver, the max-deliveries advisory dead-letters it once
                # NATS answers again.
                log.warning("cannot dead-letter; redelivering", consumer=spec.durable, error=str(exc))
                await settle(msg.nak(delay=spec.delay_after(letter.deliveries)))
                return Settled.SENT_BACK
            await settle(msg.term())
            return Settled.DEAD_LETTERED
        case decision.Hold():
            msg_text = "a Hold is carried out around the attempt, not per message"
            raise ValueError(msg_text)


async def settle(action: Awaitable[None]) -> None:
    """Ack/nak/term are best effort: if they are lost, JetStream redelivers and the record makes it a no-op."""
    try:
        await action
    except Exception as exc:  # noqa: BLE001 - a lost acknowledgement is recovered by redelivery
        log.warning("acknowledgement not delivered", error=str(exc))
