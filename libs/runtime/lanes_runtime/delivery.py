"""What every message loop of Lanes shares: fetching, holding through an outage, and carrying out a decision.

Three loops read JetStream: the services' transactional batch consumer (`consumer.py`), the node agent (a
placement is held for as long as its ranks run) and the audit recorder (a chain that must never skip).
They differ in what they do with a batch, not in how they take it or give it back, and that part lives
here once:

- `pull_batches`: fetch from a durable pull consumer until stopped; a fetch that fails because the bus is
  away took nothing, so it is tried again after a pause (the loop not ready meanwhile).
- `BatchPull`: a pull consumer's batches taken from one inbox subscription, a batch at a time (nats-py's
  `fetch` waits for each message in a task of its own).
- `hold_through_outages`: run an attempt until no server is unavailable, keeping the held messages in
  progress (their ack timers restart) and spending no delivery, with `decide`'s backoff.
- `carry_out`: ack, nak or dead-letter-then-term, as `decide` said. A message is terminated only once its
  dead letter is stored; if that fails it is sent back instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, TypeVar

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from lanes_contract.codec import MSG_ID_HEADER
from lanes_contract.streams import DEAD
from lanes_runtime import decision
from lanes_runtime.failures import is_infrastructure
from lanes_runtime.health import Readiness, describe

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


def sequence_and_deliveries(msg: Msg) -> tuple[int, int]:
    """A delivered message's stream sequence and delivery count, read from its ack subject.

    nats-py's `msg.metadata` builds a Metadata with a datetime for every message (about 4% of the telemetry
    ingest's CPU, measured with py-spy); a consumer needs these two numbers of each.
    """
    tokens = msg.reply.split(".")
    if len(tokens) == _ACK_V1_TOKENS and msg.reply.startswith(_ACK_PREFIX):
        return int(tokens[5]), int(tokens[4])  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>....
    metadata = msg.metadata  # the longer form, with a domain and an account; or not a JetStream message (raises)
    return int(metadata.sequence.stream), int(metadata.num_delivered)


_ACK_V1_TOKENS = 9


class Fetcher(Protocol):
    """What `pull_batches` reads from (a `BatchPull`; a stand-in in unit tests)."""

    async def fetch(self, batch: int, wait_s: float) -> list[Msg]:
        """Up to `batch` messages; none (or TimeoutError) when `wait_s` passed without any; NatsError: bus away."""
        ...


class BatchPull:
    """A durable pull consumer read through one inbox subscription, its messages handed over a batch at a time.

    nats-py's `fetch` awaits every message of a batch through a task and a timer of its own: about 20 µs of
    CPU per message on the bench machine, nearly half of a raw fetch+ack loop's (`bench/pipeline.py` runs
    both). Here the subscription's callback collects a request's messages and wakes the fetch once.

    A fetch is one request, `no_wait` with `expires`: the server sends what is there (up to `batch`) and ends
    the request with a status; when nothing is there, it waits for the first message until `expires` (then
    ends it with 408). Every request therefore ends on the server, soon (a `no_wait` without `expires` is
    left waiting, unanswered, while the consumer has `max_ack_pending` messages out). Messages of a request
    the fetch stopped waiting for (the bus was away: the fetch raised BusAwayError) are kept and returned by the
    next fetch: they were delivered, and dropping them would spend a delivery on nothing. One fetch at a time.
    """

    def __init__(self, nc: NatsClient, stream: str, durable: str, *, group: str | None = None) -> None:
        self._nc = nc
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._requests = 0
        self._waiting: _Request | None = None
        self._late: list[Msg] = []
        self._group = group
        """The priority group every pull names, on a consumer with a pinned client (`ConsumerSpec.pinned_s`)."""
        self.pin: str | None = None
        """The pin id the server gave this puller with its first message (it is the pinned client), else None."""

    @classmethod
    async def bind(cls, nc: NatsClient, stream: str, durable: str, *, group: str | None = None) -> BatchPull:
        """Subscribe to the inbox of an existing durable consumer's batches (pulling in `group`, if given)."""
        pull = cls(nc, stream, durable, group=group)
        pull._sub = await nc.subscribe(f"{pull._inbox}.*", cb=pull._arrived)
        return pull

    async def fetch(self, batch: int, wait_s: float) -> list[Msg]:
        """Up to `batch` messages: those there now, else the first to come within `wait_s`; none after it.

        Raises BusAwayError when the server neither sent a message nor ended the request.
        """
        if self._waiting is not None:
            msg = "BatchPull.fetch is not reentrant: one fetch at a time"
            raise RuntimeError(msg)
        if self._late:
            taken, self._late = self._late[:batch], self._late[batch:]
            return taken
        self._requests += 1
        request = _Request(f"{self._inbox}.{self._requests}", batch, asyncio.get_running_loop().create_future())
        self._waiting = request
        body: dict[str, object] = {"batch": batch, "no_wait": True, "expires": int(wait_s * 1e9)}
        if self._group is not None:
            # A pinned consumer serves only the pull that carries the pin id it handed out; the others wait.
            body["group"] = self._group
            if self.pin is not None:
                body["id"] = self.pin
        try:
            await self._nc.publish(self._next, json.dumps(body).encode(), reply=request.reply)
            with contextlib.suppress(TimeoutError):  # the server did not end it: the bus is away
                await asyncio.wait_for(request.ended, wait_s + _REQUEST_MARGIN_S)
        finally:
            self._waiting = None
        if request.error is not None:
            raise request.error
        if not request.msgs and request.ended.cancelled():
            # wait_for gave up on it: neither a message nor the status that ends every request came. The bus
            # is away (the loop is not ready meanwhile, not idle), and nothing was taken.
            msg = f"no answer to a pull request within {wait_s + _REQUEST_MARGIN_S:g} s"
            raise BusAwayError(msg)
        return request.msgs

    async def unsubscribe(self) -> None:
        """Stop receiving (messages delivered and not acked come back after their ack wait)."""
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _arrived(self, msg: Msg) -> None:
        request = self._waiting
        if msg.reply.startswith(_ACK_PREFIX):
            # A message (its subject is the one it was stored under, not the request's): the request awaited
            # takes it; without one, it came for a request no longer awaited, and the next fetch returns it.
            if self._group is not None and (pin := (msg.headers or {}).get(PIN_ID_HEADER)):
                self.pin = pin
            if request is None or request.ended.done():
                self._late.append(msg)
            else:
                request.msgs.append(msg)
                if len(request.msgs) >= request.want:
                    request.end()
            return
        if request is None or msg.subject != request.reply:
            return  # the status that ended a request no longer awaited
        status = (msg.headers or {}).get("Status", "")
        if status == _PIN_MISMATCH:
            # The server pinned another client (this one was away past the priority timeout): pull without an
            # id from now on, as a stand-by, and take the pin again if the server hands it back.
            self.pin = None
            request.end()
        elif status not in _REQUEST_ENDED:
            description = (msg.headers or {}).get("Description", "")
            refused = ConsumerGoneError if status == _NO_RESPONDERS else NatsError
            request.end(refused(f"pull request refused: {status} {description}".rstrip()))
        else:
            request.end()


class ConsumerGoneError(NatsError):
    """No one serves the consumer's pull subject (503): the consumer does not exist (deleted, or lapsed idle)."""


class BusAwayError(NatsError):
    """The server ended no pull request in time: the bus is away, and the fetch took nothing."""


_ACK_PREFIX = "$JS.ACK."
"""Every message JetStream delivers has its ack subject as reply; a status message has none."""
_REQUEST_ENDED = {"404", "408"}
"""No more messages now, request expired: the request is over, nothing is wrong."""
_NO_RESPONDERS = "503"
_PIN_MISMATCH = "423"
"""A pull carrying a pin id that is no longer the consumer's pinned client's (ADR-42)."""
PIN_ID_HEADER = "Nats-Pin-Id"
"""The header of the first message (and every later one) delivered to a newly pinned client."""
_REQUEST_MARGIN_S = 1.0
"""How much longer than its `expires` a fetch waits for the server to end a request."""


@dataclass
class _Request:
    reply: str
    want: int
    ended: asyncio.Future[None]
    msgs: list[Msg] = field(default_factory=list)
    error: Exception | None = None

    def end(self, error: Exception | None = None) -> None:
        if not self.ended.done():
            self.error = error
            self.ended.set_result(None)


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
    sub: Fetcher,
    size: int,
    stop: asyncio.Event,
    *,
    consumer: str,
    readiness: Readiness | None = None,
    in_hand: InHand | None = None,
) -> AsyncIterator[list[Msg]]:
    """Yield fetched batches until `stop` is set; an empty list when a fetch waited and found nothing.

    A fetch that fails because the bus is away makes the loop's `readiness` (its own when none is given) not
    ready until a fetch goes through again; the outage is logged there, once.

    With `in_hand`, the next batch is fetched while the caller works on the one yielded, so the fetch's round
    trip overlaps that work. Every fetched message goes into `in_hand` as it arrives: a caller holding a batch
    through an outage keeps the batch ahead in progress too, which would otherwise time out and come back,
    spending a delivery on nothing. Once `stop` is set, the batch already fetched ahead is still yielded.
    """
    servers = readiness or Readiness(consumer)

    async def fetch() -> list[Msg]:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(size, FETCH_WAIT_S)
            except TimeoutError:
                msgs = []
            except NatsError as exc:
                # Disconnected or reconnecting: nothing was taken, so nothing is lost; try again shortly.
                servers.unavailable(_FETCH, describe(exc))
                await asyncio.sleep(REFETCH_AFTER_S)
                continue
            servers.answered(_FETCH)
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


_FETCH = "fetch"
"""The cause a failing fetch reports to the loop's readiness."""


async def hold_through_outages(
    attempt: Callable[[], Awaitable[_T]],
    spec: ConsumerSpec,
    *,
    held: Iterable[InProgress] = (),
    stop: asyncio.Event | None = None,
    on_hold: Callable[[Exception, float], None] | None = None,
    readiness: Readiness | None = None,
) -> _T:
    """Run `attempt` until no server is unavailable, pausing with `decide`'s backoff between tries.

    Meanwhile the loop's `readiness` (its own when none is given) is not ready, and the outage is logged
    there: one warning when it starts, one line when it ends, not one per try. Any other failure is raised to
    the caller, which decides about the message. Raises StoppedError when `stop` is set during a pause.
    """
    servers = readiness or Readiness(spec.durable)
    cause = object()  # this hold's own: batches held side by side each wait on their own answer
    outages = 0
    while True:
        try:
            result = await attempt()
        except Exception as exc:
            if not is_infrastructure(exc):
                servers.answered(cause)  # the server answered, with a failure about the work
                raise
            outages += 1
            hold = decision.decide(decision.Unavailable(str(exc), outages), 0, spec)
            assert isinstance(hold, decision.Hold)  # noqa: S101 - decide's rule for Unavailable
            servers.unavailable(cause, describe(exc))
            if on_hold is not None:
                on_hold(exc, hold.delay_s)
            await keep_in_progress(held, hold.delay_s, spec.ack_wait_s, stop)
            continue
        servers.answered(cause)
        return result


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
