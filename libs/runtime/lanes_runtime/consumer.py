"""The consumer contract every service uses (DESIGN.md, "Processing guarantees").

One durable pull consumer per service role. For each message:

1. Decode it. A message that is not a valid event is poison: it goes to LANES_DEAD with the reason, the
   original headers and the original stream sequence, and is terminated.
2. In one PostgreSQL transaction: record (consumer, event id) as processed, run the handler (which writes
   its projection rows on the same connection) and store the events it returns in the outbox. An event
   that is already recorded skips the handler: it was processed before a crash or a lost ack.
3. After commit, publish the outbox rows of this event (their ids are deterministic, so JetStream drops a
   second copy) and delete them. Only then acknowledge the message.

Errors decide the acknowledgement explicitly: PoisonEventError dead-letters at once; anything else is
treated as transient and the message is redelivered after a delay (nak), together with the rest of the
fetched batch so that order is kept as far as JetStream allows; on the last allowed delivery it is
dead-lettered with the last error instead of being dropped. If a delivery ends without any decision (the
process died), JetStream's max-deliveries advisory is captured and the message dead-lettered from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import asyncpg
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lanes_contract.client import publish_encoded
from lanes_contract.codec import MSG_ID_HEADER, EncodedEvent, decode, encode
from lanes_contract.errors import DecodeError, ProcessingError
from lanes_contract.events import Event
from lanes_contract.streams import DEAD, STREAM_OF_FAMILY, StreamSpec
from lanes_runtime.store import Db

log = structlog.get_logger(__name__)

DEAD_REASON = "Lanes-Dead-Reason"
DEAD_STREAM = "Lanes-Dead-Stream"
DEAD_SEQUENCE = "Lanes-Dead-Sequence"
DEAD_SUBJECT = "Lanes-Dead-Subject"
DEAD_CONSUMER = "Lanes-Dead-Consumer"
DEAD_DELIVERIES = "Lanes-Dead-Deliveries"
ORIGINAL_MSG_ID = "Lanes-Original-Msg-Id"


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable consumer: which stream and subjects it reads, and how hard it retries."""

    durable: str
    stream: StreamSpec
    subjects: tuple[str, ...]
    max_deliver: int = 8
    ack_wait_s: float = 30.0
    redelivery_delays_s: tuple[float, ...] = (0.2, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
    batch: int = 64
    max_ack_pending: int | None = None
    """None: a few batches. 1: strict stream order even across a crash (a fold that depends on order)."""

    def config(self) -> ConsumerConfig:
        """The JetStream configuration of this consumer."""
        return ConsumerConfig(
            durable_name=self.durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            filter_subjects=list(self.subjects),
            max_ack_pending=self.max_ack_pending or max(self.batch * 4, 256),
        )

    def delay_after(self, deliveries: int) -> float:
        """How long to wait before the next delivery after `deliveries` failed ones."""
        return self.redelivery_delays_s[min(deliveries, len(self.redelivery_delays_s)) - 1]


@dataclass(frozen=True)
class HandlerContext:
    """What a handler gets besides the event: the open transaction and where the event came from."""

    conn: Db
    stream_seq: int
    deliveries: int
    js: JetStreamContext | None = None
    """For a handler whose output must be conditionally published inside the transaction (lifecycle's
    per-job optimistic concurrency); everything else goes through the outbox."""


Handler = Callable[[Event, HandlerContext], Awaitable[Sequence[Event]]]
"""Applies one event inside the transaction and returns the events to publish because of it."""


class Outcome(StrEnum):
    """What the consumer decided for one delivery."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    RETRY = "retry"
    DEAD_LETTERED = "dead_lettered"


class _RetryLaterError(Exception):
    def __init__(self, reason: str, delay_s: float) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


class EventConsumer:
    """Runs one ConsumerSpec with one handler until stopped. Several replicas may share the durable."""

    def __init__(self, nc: NatsClient, pool: asyncpg.Pool, spec: ConsumerSpec, handler: Handler) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._pool = pool
        self.spec = spec
        self._handler = handler
        self.outcomes: Counter[Outcome] = Counter()
        self._log = log.bind(consumer=spec.durable)

    @property
    def name(self) -> str:
        """The durable consumer name."""
        return self.spec.durable

    async def provision(self) -> None:
        """Create the durable consumer, or bring an existing one to this spec (idempotent).

        The server's consumer-create call is create-or-update: the same config is a no-op, an updatable
        change (ack wait, max deliver, filters) is applied in place, an impossible one is an APIError.
        """
        await self._js.add_consumer(self.spec.stream.name, config=self.spec.config())

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and process batches until `stop` is set; capture max-delivery advisories meanwhile."""
        await self.provision()
        sub = await self._js.pull_subscribe_bind(self.spec.durable, stream=self.spec.stream.name)
        advisory = await self._nc.subscribe(
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.spec.stream.name}.{self.spec.durable}",
            cb=self._on_max_deliveries,
        )
        self._log.info("consumer started", stream=self.spec.stream.name, subjects=self.spec.subjects)
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(self.spec.batch, timeout=0.5)
                except TimeoutError:  # nats-py raises its own subclass or the builtin, depending on the path
                    continue
                except NatsError as exc:
                    # Disconnected or reconnecting: nothing was taken, so nothing is lost; try again shortly.
                    self._log.warning("fetch failed; retrying", error=str(exc) or type(exc).__name__)
                    await asyncio.sleep(1.0)
                    continue
                await self.process_batch(msgs)
        finally:
            with contextlib.suppress(Exception):
                await advisory.unsubscribe()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def process_batch(self, msgs: Sequence[Msg]) -> None:
        """Process messages in order; after a transient error, send the rest of the batch back too."""
        for index, msg in enumerate(msgs):
            try:
                outcome = await self._process(msg)
            except _RetryLaterError as retry:
                self._log.warning("redelivering", reason=str(retry), delay_s=retry.delay_s, seq=_seq(msg))
                for pending in msgs[index:]:
                    await _settle(pending.nak(delay=retry.delay_s))
                self.outcomes[Outcome.RETRY] += len(msgs) - index
                return
            self.outcomes[outcome] += 1

    async def _process(self, msg: Msg) -> Outcome:
        meta = msg.metadata
        try:
            event = decode(msg.subject, msg.headers, msg.data)
        except DecodeError as exc:
            return await self._give_up(msg, str(exc))
        try:
            fresh, outputs = await self._apply(event, meta.sequence.stream, meta.num_delivered)
            if outputs or not fresh:  # a duplicate may have left outputs unpublished when its process died
                await self._flush_outbox(event.id)
        except ProcessingError as exc:
            if not exc.retryable:
                return await self._give_up(msg, f"{type(exc).__name__}: {exc}")
            return await self._retry_or_give_up(msg, exc, exc.delay_s)
        except Exception as exc:  # noqa: BLE001 - unknown failures are retried, then dead-lettered, never dropped
            return await self._retry_or_give_up(msg, exc, None)
        await _settle(msg.ack())
        return Outcome.PROCESSED if fresh else Outcome.DUPLICATE

    async def _retry_or_give_up(self, msg: Msg, exc: Exception, delay_s: float | None) -> Outcome:
        deliveries = msg.metadata.num_delivered
        reason = f"{type(exc).__name__}: {exc}"
        if deliveries >= self.spec.max_deliver:
            return await self._give_up(msg, f"gave up after {deliveries} deliveries; last error: {reason}")
        raise _RetryLaterError(reason, delay_s if delay_s is not None else self.spec.delay_after(deliveries))

    async def _give_up(self, msg: Msg, reason: str) -> Outcome:
        meta = msg.metadata
        self._log.error("dead-lettering", reason=reason, seq=meta.sequence.stream)
        try:
            await self._dead_letter(
                subject=msg.subject,
                headers=msg.headers,
                payload=msg.data,
                stream_seq=meta.sequence.stream,
                reason=reason,
                deliveries=meta.num_delivered,
            )
        except Exception as exc:
            # Without a dead letter the message must not be terminated: send it back instead. Past
            # max_deliver, the max-deliveries advisory dead-letters it once NATS answers again.
            raise _RetryLaterError(
                f"cannot dead-letter ({exc}); {reason}", self.spec.delay_after(meta.num_delivered)
            ) from exc
        await _settle(msg.term())
        return Outcome.DEAD_LETTERED

    async def _apply(self, event: Event, stream_seq: int, deliveries: int) -> tuple[bool, int]:
        """Run the handler and record the event in one transaction.

        Returns whether the event was new (False: already recorded, handler skipped) and how many output
        events were stored in the outbox.
        """
        async with self._pool.acquire() as conn, conn.transaction():
            recorded = await conn.fetchval(
                """INSERT INTO lanes_processed (consumer, event_id, stream, stream_seq) VALUES ($1, $2, $3, $4)
                   ON CONFLICT DO NOTHING RETURNING true""",
                self.spec.durable,
                event.id,
                self.spec.stream.name,
                stream_seq,
            )
            if not recorded:
                return False, 0
            with structlog.contextvars.bound_contextvars(event_id=event.id, job_id=event.jobid):
                outputs = await self._handler(event, HandlerContext(conn, stream_seq, deliveries, self._js))
            rows = [(output, encode(output)) for output in outputs]
            if not rows:
                return True, 0
            await conn.executemany(
                """INSERT INTO lanes_outbox (consumer, cause_id, subject, stream, headers, payload)
                   VALUES ($1, $2, $3, $4, $5, $6)""",
                [
                    (
                        self.spec.durable,
                        event.id,
                        encoded.subject,
                        STREAM_OF_FAMILY[output.family].name,
                        json.dumps(encoded.headers),
                        encoded.payload,
                    )
                    for output, encoded in rows
                ],
            )
            return True, len(rows)

    async def _flush_outbox(self, cause_id: str) -> None:
        rows = await self._pool.fetch(
            """SELECT id, subject, stream, headers, payload FROM lanes_outbox
               WHERE consumer = $1 AND cause_id = $2 ORDER BY id""",
            self.spec.durable,
            cause_id,
        )
        for row in rows:
            encoded = EncodedEvent(row["subject"], json.loads(row["headers"]), bytes(row["payload"]))
            await publish_encoded(self._js, encoded, stream=row["stream"])
            await self._pool.execute("DELETE FROM lanes_outbox WHERE id = $1", row["id"])

    async def _dead_letter(
        self,
        *,
        subject: str,
        headers: Mapping[str, str] | None,
        payload: bytes,
        stream_seq: int,
        reason: str,
        deliveries: int,
    ) -> None:
        original = dict(headers or {})
        dead_headers = {k: v for k, v in original.items() if not k.startswith("Nats-")}
        if MSG_ID_HEADER in original:
            dead_headers[ORIGINAL_MSG_ID] = original[MSG_ID_HEADER]
        dead_headers |= {
            DEAD_REASON: " ".join(reason.split())[:1024],  # header values are single-line
            DEAD_STREAM: self.spec.stream.name,
            DEAD_SEQUENCE: str(stream_seq),
            DEAD_SUBJECT: subject,
            DEAD_CONSUMER: self.spec.durable,
            DEAD_DELIVERIES: str(deliveries),
            # One dead letter per (stream, sequence, consumer), however often this runs.
            MSG_ID_HEADER: f"dead-{self.spec.stream.name}-{stream_seq}-{self.spec.durable}",
        }
        dead_subject = f"lanes.dead.{self.spec.stream.name}.{self.spec.durable}"
        await self._js.publish(dead_subject, payload, headers=dead_headers, stream=DEAD.name)

    async def _on_max_deliveries(self, advisory: Msg) -> None:
        try:
            body = json.loads(advisory.data)
            seq = int(body["stream_seq"])
            deliveries = int(body.get("deliveries", self.spec.max_deliver))
            original = await self._js.get_msg(self.spec.stream.name, seq)
            await self._dead_letter(
                subject=original.subject or "",
                headers=original.headers,
                payload=original.data or b"",
                stream_seq=seq,
                reason="max deliveries reached without a decision (the process handling it died or timed out)",
                deliveries=deliveries,
            )
        except Exception:  # noqa: BLE001 - a subscription callback must not die; the failure is logged
            self._log.exception("could not dead-letter from a max-deliveries advisory", advisory=advisory.data[:512])


def _seq(msg: Msg) -> int:
    return msg.metadata.sequence.stream


async def _settle(action: Awaitable[None]) -> None:
    """Ack/nak/term are best effort: if they are lost, JetStream redelivers and the record makes it a no-op."""
    try:
        await action
    except Exception as exc:  # noqa: BLE001 - a lost acknowledgement is recovered by redelivery
        log.warning("acknowledgement not delivered", error=str(exc))


async def record_only(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """A handler with no effect beyond the processed-event record (services that only observe, for now)."""
    del event, ctx
    return ()
