"""The consumer contract every service uses, one fetched batch at a time (docs/architecture.md: guarantees).

One durable pull consumer per service role. For each fetched batch:

1. Decode every message. A message that is not a valid event is poison: it goes to LANES_DEAD with the
   reason, the original headers and the original stream sequence, and is terminated. With a keyring, each
   message is verified first (`lanes_contract.signing.verified_signer`): a forged one (unsigned, an unknown
   key, a bad signature, a signer that may not say it) is dead-lettered the same way, never retried, and
   never reaches a handler.
2. In one PostgreSQL transaction: record the batch's event ids as processed (one multi-row insert; an id
   already recorded is a duplicate and skips its handler: it was processed before a crash or a lost ack),
   run the handlers in stream order (they write their effects on the same connection) and store the
   events they return in the outbox.
   If a handler fails, the transaction is rolled back and the batch is retried once, one event per
   transaction, so the failing event is settled alone and its neighbours go through on that single retry.
3. After commit, publish the batch's outbox rows (their ids are deterministic, so JetStream drops a second
   copy) with the publish acknowledgements awaited together, delete them, and only then acknowledge.

The next batch is fetched while one is processed (the fetch's round trip overlaps the work). With
`in_flight` above one, that many batches are processed at once, each in its own transaction, as that many
replicas would.

Every acknowledgement is chosen by `decision.decide`; this loop only carries it out. An infrastructure
failure (a server unreachable or too slow) holds the batch: every message in hand (the batch and the one
fetched ahead) is marked in progress, the consumer is marked not ready, and the batch is tried again with
backoff, without spending a delivery. A `SELECT 1` probe also marks it not ready within seconds of PostgreSQL
no longer answering, busy or idle, instead of when a statement times out; otherwise a consumer is ready from
its start until it fails (`lanes_runtime.health`).
If a delivery ends without any decision (the process died), JetStream's max-deliveries advisory is
captured and the message dead-lettered from it.

A consumer whose fold depends on order (`ConsumerSpec.ordered`) stages its batches in `lanes_inbox`
instead of running the handler, and acknowledges them; `fold` then applies staged events whose stream
sequence is at or below the consumer's ack floor, in stream order, many keys per transaction. See
docs/ordering.md for why that order holds across crashes and replicas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

import asyncpg
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lanes_contract.client import publish_encoded
from lanes_contract.codec import EncodedEvent, decode, encode
from lanes_contract.errors import DecodeError
from lanes_contract.events import Event
from lanes_contract.signing import Keyring, SignatureError, verified_signer
from lanes_contract.streams import STREAM_OF_FAMILY, StreamSpec
from lanes_runtime import decision
from lanes_runtime.delivery import (
    BatchPull,
    DeadLetter,
    InHand,
    Settled,
    StoppedError,
    carry_out,
    dead_letter,
    hold_through_outages,
    pull_batches,
    sequence_and_deliveries,
)
from lanes_runtime.failures import classify, is_infrastructure
from lanes_runtime.health import DatabaseWatch, Readiness
from lanes_runtime.metrics import ConsumerMetrics
from lanes_runtime.store import Db
from lanes_runtime.tracing import event_span, sdk_configured, traced
from lanes_runtime.upkeep import PINNED_CLIENT, DurableUpkeep, PostgresFloors

log = structlog.get_logger(__name__)
_T = TypeVar("_T")


PRIORITY_GROUP = "lanes"
"""The one priority group of a pinned consumer (the server allows one group per consumer)."""


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
    """None: a few batches in flight across the replicas sharing the durable."""
    ordered: bool = False
    """True: each key's (job's) events are applied in stream order, across crashes and replicas
    (staged in the inbox, folded below the ack floor). For folds whose result depends on order."""
    in_flight: int = 1
    """Batches processed at once, each in its own transaction, as replicas would: one batch's statements wait
    on PostgreSQL while another's handlers run. Only for handlers that two replicas may already run side by
    side; an ordered consumer takes one (its fold reads the ack floor its batches' acks raise)."""

    pinned_s: float | None = None
    """Set: the durable has a priority group whose policy is a pinned client (NATS 2.11+, ADR-42): the server
    delivers to one replica at a time, and moves the pin to another (pulling as a stand-by) when the pinned one
    has not pulled for this many seconds. For a service whose state per key must not be built by two replicas
    at once (telemetry's election of a job's first error). None: every replica is served."""

    def __post_init__(self) -> None:
        if self.in_flight < 1 or (self.ordered and self.in_flight != 1):
            msg = f"{self.durable}: in_flight must be at least 1, and 1 for an ordered consumer"
            raise ValueError(msg)

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

    @property
    def group(self) -> str | None:
        """The priority group every pull names (a pinned consumer's), else None."""
        return None if self.pinned_s is None else PRIORITY_GROUP

    def create_request(self, config: ConsumerConfig) -> dict[str, object]:
        """The body of `$JS.API.CONSUMER.CREATE.<stream>.<durable>` that makes `config` (this spec's).

        A pinned consumer's body carries its priority group, which nats-py's config does not.
        """
        body: dict[str, Any] = config.as_dict()
        body["name"] = self.durable
        if self.pinned_s is not None:
            body |= {
                "priority_groups": [PRIORITY_GROUP],
                "priority_policy": PINNED_CLIENT,
                "priority_timeout": int(self.pinned_s * 1e9),
            }
        return {"stream_name": self.stream.name, "config": body}

    @property
    def retention_s(self) -> float:
        """How long a processed record must be kept to recognise a redelivery or a re-publication.

        JetStream itself drops a re-published id within the stream's duplicate window, and an unacknowledged
        message comes back at most max_deliver times, each after ack_wait or a redelivery delay. After both
        horizons a record can no longer be needed.
        """
        return self.stream.duplicate_window_s + self.max_deliver * self.ack_wait_s + sum(self.redelivery_delays_s)

    def delay_after(self, deliveries: int) -> float:
        """How long to wait before the next delivery after `deliveries` failed ones."""
        return self.redelivery_delays_s[max(1, min(deliveries, len(self.redelivery_delays_s))) - 1]


Caused = tuple[Event, Event]
"""An output event with the event that caused it (the outbox's row)."""
BeforeCommit = Callable[[], Awaitable[Sequence[Caused] | None]]


@dataclass
class TransactionScope:
    """What handlers share for the rest of one transaction (a batch): a cache, and work to do before commit.

    A handler that reads and rewrites the same rows for every event (a fold) can keep them here and write
    them once, just before the batch commits. Such work may also produce events (an election over
    everything the batch added): they go to the outbox with the batch's other outputs.
    """

    deferred: bool = False
    """True when the consumer runs `flush` before commit; a scope a caller made itself writes at once."""
    isolated: bool = False
    """True when each handler runs in its own savepoint, to settle a failure alone (a batch folded again after
    one failed): an effect outside the transaction that may fail for one event's sake then belongs in the
    handler, not in `before_commit`, where its failure would be the whole batch's."""
    keys: frozenset[str] = frozenset()
    """The subject keys (job or node ids) of the events the transaction applies: a handler may read all their
    rows in its first query instead of one query per key."""
    cache: dict[object, Any] = field(default_factory=dict)
    _before_commit: list[BeforeCommit] = field(default_factory=list)

    def before_commit(self, action: BeforeCommit) -> None:
        """Run `action` inside the transaction, after the last handler and before the commit."""
        self._before_commit.append(action)

    async def flush(self) -> list[Caused]:
        """Run the registered actions, in order (the consumer calls this); return the events they produced."""
        produced: list[Caused] = []
        while self._before_commit:  # an action may register another
            actions, self._before_commit = self._before_commit, []
            for action in actions:
                produced += await action() or ()
        return produced


@dataclass(frozen=True)
class HandlerContext:
    """What a handler gets besides the event: the open transaction and where the event came from."""

    conn: Db
    stream_seq: int
    deliveries: int
    scope: TransactionScope = field(default_factory=TransactionScope)


Handler = Callable[[Event, HandlerContext], Awaitable[Sequence[Event]]]
"""Applies one event inside the transaction and returns the events to publish because of it."""


class Outcome(StrEnum):
    """What the consumer did with deliveries, tallied in `EventConsumer.outcomes`."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    RETRY = "retry"
    """Sent back for redelivery (spends a delivery)."""
    STAGED = "staged"
    """Recorded in the inbox of an ordered consumer, to be folded (counted PROCESSED when folded)."""
    HELD = "held"
    """Kept and tried again in place while a server was unavailable (spends none)."""
    DEAD_LETTERED = "dead_lettered"


@dataclass
class _Item:
    """One fetched message, decoded if it could be, with its stream sequence and delivery count."""

    msg: Msg
    event: Event | None
    invalid: str | None = None
    seq: int = field(init=False)
    deliveries: int = field(init=False)

    def __post_init__(self) -> None:
        # Read once: the batch's loops ask for them several times per message.
        self.seq, self.deliveries = sequence_and_deliveries(self.msg)


class _InFlight:
    """The batches being processed, at most `limit` at once."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, work: Coroutine[Any, Any, None]) -> None:
        """Start `work`; return once fewer than `limit` run (with a limit of one: once it is done).

        A batch that failed (a bug: handler failures are settled inside) fails the loop, as it would without
        the task around it.
        """
        self._tasks.add(asyncio.ensure_future(work))
        await self._until_fewer_than(self._limit)

    async def drain(self) -> None:
        """Wait for every batch still being processed."""
        await self._until_fewer_than(1)

    async def _until_fewer_than(self, count: int) -> None:
        while len(self._tasks) >= count:
            done, self._tasks = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()

    def cancel(self) -> None:
        """Abandon the batches still running (the loop failed): their messages come back after the ack wait."""
        for task in self._tasks:
            task.cancel()


class _HandlerFailedError(Exception):
    """A handler failed inside the batch transaction: roll the batch back and retry it singly."""


class EventConsumer:
    """Runs one ConsumerSpec with one handler until stopped. Several replicas may share the durable."""

    def __init__(
        self,
        nc: NatsClient,
        pool: asyncpg.Pool,
        spec: ConsumerSpec,
        handler: Handler,
        *,
        metrics: ConsumerMetrics | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._pool = pool
        self.spec = spec
        self._handler = handler
        self.outcomes: Counter[Outcome] = Counter()
        self._metrics = metrics or ConsumerMetrics.for_consumer(spec.durable)
        self._readiness = Readiness(spec.durable, self._metrics.ready)
        self._upkeep = DurableUpkeep(self._js, PostgresFloors(pool), spec, self._readiness)
        """Restores the durable if it disappears or drifts from the spec (`lanes_runtime.upkeep`)."""
        self._in_hand = InHand()
        """Messages fetched (the batch at work and the one fetched ahead) and not yet settled."""
        self._tracing = sdk_configured()
        """Whether handlers run in spans: asked once per batch (a tracer provider may be set at any time)."""
        self._decoded: dict[int, Event] = {}
        """Events this process staged, decoded, by stream sequence, until it folds them."""
        self._log = log.bind(consumer=spec.durable)
        self._keyring = keyring
        """The keys every event is verified against before its handler (None: signatures are not checked)."""

    @property
    def name(self) -> str:
        """The durable consumer name."""
        return self.spec.durable

    @property
    def ready(self) -> bool:
        """True from the start; False while a server it depends on is unavailable, and once it failed.

        The `lanes_consumer_ready` gauge always says the same: both are set in one place (`Readiness`).
        """
        return self._readiness.ready

    async def provision(self) -> None:
        """Create the durable consumer, restore it, or bring an existing one to this spec (idempotent).

        A durable that matches the spec is left as it is. One that is missing after it ran is created again
        right after its recorded ack floor, one that drifted is updated in place or made again from there
        (`lanes_runtime.upkeep`); `run` keeps checking it.
        """
        await self._upkeep.provision()

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and process batches until `stop` is set; capture max-delivery advisories meanwhile.

        A failure that ends the loop (not a handler's: those are settled inside) makes it not ready for good.
        """
        with self._readiness.failing_for_good():
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        await self.provision()
        sub = await BatchPull.bind(self._nc, self.spec.stream.name, self.spec.durable, group=self.spec.group)
        advisory = await self._nc.subscribe(
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.spec.stream.name}.{self.spec.durable}",
            cb=self._on_max_deliveries,
        )
        self._log.info("consumer started", stream=self.spec.stream.name, subjects=self.spec.subjects)
        next_prune = time.monotonic() + _PRUNE_EVERY_S
        working = _InFlight(self.spec.in_flight)
        try:
            async with DatabaseWatch.watching(self._pool, self._readiness), self._upkeep.kept(stop):
                batches = pull_batches(
                    sub, self.spec.batch, stop, consumer=self.name, readiness=self._readiness, in_hand=self._in_hand
                )
                async for msgs in batches:
                    if msgs:
                        await working.start(self.process_batch(msgs, stop))
                    if time.monotonic() >= next_prune:
                        next_prune = time.monotonic() + _PRUNE_EVERY_S
                        with contextlib.suppress(Exception):  # bookkeeping: it is tried again at the next turn
                            await prune_processed(self._pool, self.spec.durable, self.spec.retention_s)
                    if self.spec.ordered:
                        try:
                            await self._hold_through_outages(self.fold, stop)
                        except StoppedError:
                            pass
                        except Exception:  # noqa: BLE001 - the staged events stay; the next turn folds them again
                            self._log.exception("fold failed; trying again")
                            await asyncio.sleep(self.spec.delay_after(1))
                await working.drain()
        finally:
            working.cancel()
            with contextlib.suppress(Exception):
                await advisory.unsubscribe()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def process_batch(self, msgs: Sequence[Msg], stop: asyncio.Event | None = None) -> None:
        """Process one fetched batch: one transaction, then the outbox, then each message's decision."""
        self._in_hand.add(msgs)
        self._tracing = sdk_configured()
        items = await _decoded_batch(msgs, self._keyring)
        self._metrics.batch_size.observe(len(items))
        self._metrics.pending.set(msgs[-1].metadata.num_pending or 0)
        with contextlib.suppress(StoppedError):
            outcomes = await self._hold_through_outages(lambda: self._settle_batch(items), stop, items)
            for item, outcome in zip(items, outcomes, strict=True):
                await self._carry_out(item, outcome)
            if self.spec.ordered:
                # The fold reads the ack floor: let the server have the acks before it asks.
                with contextlib.suppress(Exception):
                    await self._nc.flush()

    async def _settle_batch(self, items: list[_Item]) -> list[decision.Outcome]:
        """The batch's outcomes once its transaction committed and its outbox was published."""
        try:
            outcomes, causes = await self._transact(items)
            # Rows may also be left from an earlier delivery of a duplicate, committed by a process that died
            # before it published them. No other event of the batch can have any: reading only for these
            # spares most batches the read (and its connection's reset).
            causes |= {
                item.event.id
                for item, outcome in zip(items, outcomes, strict=True)
                if item.event is not None and isinstance(outcome, decision.Duplicate)
            }
        except _HandlerFailedError:
            outcomes = [await self._transact_one(item) for item in items]
            causes = {item.event.id for item in items if item.event is not None}
        await self._flush_outbox(sorted(causes))
        return outcomes

    async def _hold_through_outages(
        self, attempt: Callable[[], Awaitable[_T]], stop: asyncio.Event | None, items: Sequence[_Item] = ()
    ) -> _T:
        """Run `attempt` until no server is unavailable, not ready meanwhile.

        Every message in hand is kept in progress meanwhile: `items`, and the batch fetched ahead.
        """

        def on_hold(_: Exception, __: float) -> None:
            self.outcomes[Outcome.HELD] += len(items)
            self._metrics.held.inc(len(items))

        return await hold_through_outages(
            attempt, self.spec, held=self._in_hand, stop=stop, on_hold=on_hold, readiness=self._readiness
        )

    async def _transact(self, items: list[_Item]) -> tuple[list[decision.Outcome], set[str]]:
        """The whole batch in one transaction: its outcomes, and the events whose outputs it put in the outbox.

        Raises _HandlerFailedError (rolled back) if a handler fails.
        """
        started = time.perf_counter()
        async with self._pool.acquire() as conn, conn.transaction():
            fresh = await self._record(conn, items)
            scope = TransactionScope(deferred=True, keys=frozenset(_key_of(item.msg.subject) for item in items))
            outcomes: list[decision.Outcome] = []
            outbox: list[Caused] = []
            for item in items:
                if item.event is None:
                    outcomes.append(decision.Invalid(item.invalid or "invalid"))
                elif item.event.id not in fresh or item.seq != fresh[item.event.id]:
                    outcomes.append(decision.Duplicate())
                elif self.spec.ordered:
                    outcomes.append(decision.Processed())
                else:
                    try:
                        outputs = await self._run_handler(conn, item.event, item.seq, item.deliveries, scope)
                    except Exception as exc:
                        if is_infrastructure(exc):
                            raise
                        raise _HandlerFailedError from exc
                    outbox += [(item.event, output) for output in outputs]
                    outcomes.append(decision.Processed())
            try:
                outbox += await scope.flush()
            except Exception as exc:
                if is_infrastructure(exc):
                    raise
                raise _HandlerFailedError from exc
            if self.spec.ordered:
                await self._stage(conn, [item for item in items if item.event is not None and item.event.id in fresh])
            await self._store_outbox(conn, outbox)
        self._metrics.commit_seconds.observe(time.perf_counter() - started)
        return outcomes, {cause.id for cause, _ in outbox}

    async def _transact_one(self, item: _Item) -> decision.Outcome:
        """One event in its own transaction: the single retry that isolates a failing event."""
        if item.event is None:
            return decision.Invalid(item.invalid or "invalid")
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                fresh = await self._record(conn, [item])
                if item.event.id not in fresh:
                    return decision.Duplicate()
                scope = TransactionScope(deferred=True)
                outputs = await self._run_handler(conn, item.event, item.seq, item.deliveries, scope)
                produced = await scope.flush()
                await self._store_outbox(conn, [*((item.event, output) for output in outputs), *produced])
        except Exception as exc:
            if is_infrastructure(exc):
                raise
            return classify(exc)
        return decision.Processed()

    async def _run_handler(
        self, conn: Db, event: Event, stream_seq: int, deliveries: int, scope: TransactionScope
    ) -> Sequence[Event]:
        started = time.perf_counter()
        context = HandlerContext(conn, stream_seq, deliveries, scope)
        # Set and reset by hand (not `bound_contextvars`, which copies the whole context each time): this
        # runs once per event.
        bound = structlog.contextvars.bind_contextvars(event_id=event.id, job_id=event.jobid)
        try:
            if self._tracing:
                with event_span(event, self.spec.durable):
                    outputs: Sequence[Event] = traced(await self._handler(event, context))
            else:
                outputs = await self._handler(event, context)
        finally:
            structlog.contextvars.reset_contextvars(**bound)
        self._metrics.handler_seconds.observe(time.perf_counter() - started)
        return outputs

    async def _record(self, conn: Db, items: Sequence[_Item]) -> dict[str, int]:
        """Record the decodable events as processed; return the newly recorded ids with their sequences.

        One multi-row insert; ids are sorted so that two replicas inserting overlapping batches take their
        row locks in the same order. An id seen twice in one batch is recorded for its first message only.
        """
        first: dict[str, int] = {}
        for item in items:
            if item.event is not None:
                first.setdefault(item.event.id, item.seq)
        if not first:
            return {}
        ids = sorted(first)
        rows = await conn.fetch(
            """INSERT INTO lanes_processed (consumer, event_id, stream, stream_seq)
               SELECT $1, id, $2, seq FROM unnest($3::text[], $4::bigint[]) AS t(id, seq)
               ON CONFLICT DO NOTHING RETURNING event_id, stream_seq""",
            self.spec.durable,
            self.spec.stream.name,
            ids,
            [first[i] for i in ids],
        )
        return {row["event_id"]: int(row["stream_seq"]) for row in rows}

    async def _store_outbox(self, conn: Db, outputs: Sequence[Caused]) -> None:
        if not outputs:
            return
        encoded = [(cause, output, encode(output)) for cause, output in outputs]
        await conn.execute(
            """INSERT INTO lanes_outbox (consumer, cause_id, subject, stream, headers, payload)
               SELECT $1, c, s, st, h::jsonb, p FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[])
                   WITH ORDINALITY AS t(c, s, st, h, p, n) ORDER BY n""",
            self.spec.durable,
            [cause.id for cause, _, _ in encoded],
            [e.subject for _, _, e in encoded],
            [STREAM_OF_FAMILY[output.family].name for _, output, _ in encoded],
            [json.dumps(e.headers) for _, _, e in encoded],
            [e.payload for _, _, e in encoded],
        )

    async def _flush_outbox(self, cause_ids: Sequence[str]) -> None:
        """Publish the outbox rows of these causes, waiting for all publish acks together, then delete them.

        The publishes are issued in outbox order on one connection, so the server stores them in that order.
        """
        if not cause_ids:
            return
        rows = await self._pool.fetch(
            """SELECT id, subject, stream, headers, payload FROM lanes_outbox
               WHERE consumer = $1 AND cause_id = ANY($2::text[]) ORDER BY id""",
            self.spec.durable,
            list(cause_ids),
        )
        if not rows:
            return
        publishes = [
            asyncio.ensure_future(
                publish_encoded(
                    self._js,
                    EncodedEvent(row["subject"], json.loads(row["headers"]), bytes(row["payload"])),
                    stream=row["stream"],
                )
            )
            for row in rows
        ]
        await asyncio.gather(*publishes)
        await self._pool.execute("DELETE FROM lanes_outbox WHERE id = ANY($1::bigint[])", [row["id"] for row in rows])

    async def _carry_out(self, item: _Item, outcome: decision.Outcome) -> None:
        """Carry out `decide`'s verdict for one message, and count what became of it."""
        verdict = decision.decide(outcome, item.deliveries, self.spec)
        if isinstance(verdict, decision.Nak):
            self._log.warning("redelivering", reason=_reason(outcome), delay_s=verdict.delay_s, seq=item.seq)
        settled = await carry_out(self._js, item.msg, verdict, self.spec)
        self._in_hand.discard(item.msg)
        match settled:
            case Settled.ACKED if isinstance(outcome, decision.Duplicate):
                tally = Outcome.DUPLICATE
            case Settled.ACKED:
                tally = Outcome.STAGED if self.spec.ordered else Outcome.PROCESSED
            case Settled.SENT_BACK:
                tally = Outcome.RETRY
            case Settled.DEAD_LETTERED:
                tally = Outcome.DEAD_LETTERED
        self.outcomes[tally] += 1
        self._metrics.count(tally)

    # --- per-key ordered consumers -------------------------------------------------------------------

    async def _stage(self, conn: Db, items: Sequence[_Item]) -> None:
        if not items:
            return
        await conn.execute(
            """INSERT INTO lanes_inbox (consumer, stream_seq, event_id, subject, headers, payload)
               SELECT $1, q, i, s, h::jsonb, p
               FROM unnest($2::bigint[], $3::text[], $4::text[], $5::text[], $6::bytea[]) AS t(q, i, s, h, p)
               ON CONFLICT DO NOTHING""",
            self.spec.durable,
            [item.seq for item in items],
            [item.event.id for item in items if item.event is not None],
            [item.msg.subject for item in items],
            [json.dumps(dict(item.msg.headers or {})) for item in items],
            [item.msg.data for item in items],
        )
        # The fold will want these events decoded; a stream sequence always names the same message, so what
        # is kept here is right whoever commits (or rolls back) the staging, and whichever replica folds.
        for item in items:
            if item.event is not None:
                self._decoded[item.seq] = item.event
        while len(self._decoded) > _DECODED_KEPT:
            del self._decoded[next(iter(self._decoded))]  # the oldest first: another replica folded them

    async def fold(self) -> int:
        """Apply staged events at or below the ack floor, in stream order; return how many were settled.

        One replica folds a consumer at a time (a transaction-scoped advisory lock; the others skip).
        A failing event holds back the later events of its key (job) until it succeeds or is dead-lettered
        after max_deliver attempts; other keys go on.

        A batch is first folded without a savepoint per event (two round trips each, most of a fold's cost).
        If a handler fails there, the whole batch is rolled back and folded again with savepoints, so the
        failure is settled alone. Handlers' effects outside the transaction must therefore be idempotent, as
        they already must be for redeliveries (the lifecycle's transitions adopt their own earlier append).
        """
        settled = 0
        while True:
            try:
                done, more = await self._fold_once(careful=False)
            except _HandlerFailedError:
                done, more = await self._fold_once(careful=True)
            settled += done
            if not more:
                return settled

    async def _fold_once(self, *, careful: bool) -> tuple[int, bool]:
        started = time.perf_counter()
        self._tracing = sdk_configured()
        counted: list[Outcome] = []
        async with self._pool.acquire() as conn, conn.transaction():
            if not await conn.fetchval(
                "SELECT pg_try_advisory_xact_lock(hashtext('lanes_inbox'), hashtext($1))", self.spec.durable
            ):
                return 0, False
            rows = await conn.fetch(
                """SELECT stream_seq, event_id, subject, headers, payload, attempts FROM lanes_inbox
                   WHERE consumer = $1 ORDER BY stream_seq LIMIT $2""",
                self.spec.durable,
                self.spec.batch,
            )
            if not rows:
                return 0, False
            floor = await self._ack_floor()
            keys = frozenset(_key_of(row["subject"]) for row in rows if int(row["stream_seq"]) <= floor)
            scope = TransactionScope(deferred=True, isolated=careful, keys=keys)
            blocked: set[str] = set()
            finished: list[int] = []
            retried: list[int] = []
            outbox: list[Caused] = []
            for row in rows:
                seq = int(row["stream_seq"])
                key = _key_of(row["subject"])
                if seq > floor or key in blocked:
                    blocked.add(key)
                    continue
                outcome, outputs, event = await self._fold_event(conn, row, scope, careful=careful)
                verdict = decision.decide(outcome, int(row["attempts"]) + 1, self.spec)
                match verdict:
                    case decision.Ack():
                        finished.append(seq)
                        outbox += [(event, output) for output in outputs] if event is not None else []
                        counted.append(Outcome.PROCESSED)
                    case decision.Term(reason):
                        headers = json.loads(row["headers"])
                        await self._dead_letter(
                            subject=row["subject"],
                            headers=headers,
                            payload=bytes(row["payload"]),
                            stream_seq=seq,
                            reason=reason,
                            deliveries=int(row["attempts"]) + 1,
                        )
                        finished.append(seq)
                        counted.append(Outcome.DEAD_LETTERED)
                    case _:
                        retried.append(seq)
                        blocked.add(key)
                        counted.append(Outcome.RETRY)
            try:
                outbox += await scope.flush()
            except Exception as exc:
                if careful or is_infrastructure(exc):
                    raise
                raise _HandlerFailedError from exc
            await conn.execute(
                "DELETE FROM lanes_inbox WHERE consumer = $1 AND stream_seq = ANY($2::bigint[])",
                self.spec.durable,
                finished,
            )
            await conn.execute(
                "UPDATE lanes_inbox SET attempts = attempts + 1 WHERE consumer = $1 AND stream_seq = ANY($2::bigint[])",
                self.spec.durable,
                retried,
            )
            await self._store_outbox(conn, outbox)
        for settled in counted:  # counted once the fold committed (a rolled-back fast pass counts nothing)
            self.outcomes[settled] += 1
            self._metrics.count(settled)
        self._metrics.commit_seconds.observe(time.perf_counter() - started)
        await self._flush_outbox([event.id for event, _ in outbox])
        if retried:
            await asyncio.sleep(self.spec.delay_after(1))
        return len(finished), len(rows) == self.spec.batch and bool(finished)

    async def _fold_event(
        self, conn: Db, row: asyncpg.Record, scope: TransactionScope, *, careful: bool
    ) -> tuple[decision.Outcome, Sequence[Event], Event | None]:
        """Run the handler for one staged event; `careful`, in a savepoint, so that a failure is its alone.

        Outside a savepoint (the fast pass) a failing handler raises _HandlerFailedError: the batch is
        rolled back and folded carefully. An infrastructure failure aborts the fold either way.
        """
        seq, deliveries = int(row["stream_seq"]), int(row["attempts"]) + 1
        event = self._decoded.pop(seq, None)
        if event is None:  # staged by another replica, or before a restart
            try:
                event = decode(row["subject"], json.loads(row["headers"]), bytes(row["payload"]))
            except DecodeError as exc:
                return decision.Invalid(str(exc)), (), None
        if not careful:
            try:
                outputs = await self._run_handler(conn, event, seq, deliveries, scope)
            except Exception as exc:
                if is_infrastructure(exc):
                    raise
                raise _HandlerFailedError from exc
            return decision.Processed(), outputs, event
        before = dict(scope.cache)
        try:
            async with conn.transaction():
                outputs = await self._run_handler(conn, event, seq, deliveries, scope)
        except Exception as exc:
            scope.cache = before  # what the failed handler kept is rolled back with its savepoint
            if is_infrastructure(exc):
                raise
            return classify(exc), (), event
        return decision.Processed(), outputs, event

    async def _ack_floor(self) -> int:
        """The highest stream sequence below which every message of this consumer was acknowledged."""
        return await self._upkeep.ack_floor()  # 0 while the durable is missing: nothing folds until it is back

    # --- dead letters ---------------------------------------------------------------------------------

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
        await dead_letter(
            self._js,
            DeadLetter(self.spec.stream.name, self.spec.durable, subject, stream_seq, deliveries, reason),
            headers,
            payload,
        )

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
            self._metrics.count(Outcome.DEAD_LETTERED)
        except Exception:  # noqa: BLE001 - a subscription callback must not die; the failure is logged
            self._log.exception("could not dead-letter from a max-deliveries advisory", advisory=advisory.data[:512])


_DECODED_KEPT = 8192
"""Staged events kept decoded for the fold: 32 lifecycle folds' worth. Those another replica folded age out,
oldest first, so a replica that stages but does not fold holds a few MiB, not a growing map."""
_PRUNE_EVERY_S = 60.0
_PRUNE_CHUNK = 10_000


async def prune_processed(pool: asyncpg.Pool, consumer: str, retention_s: float) -> int:
    """Delete the consumer's processed records older than `retention_s`, in bounded chunks; return how many.

    The table then holds at most the records of one retention window, however many events went through.
    """
    deleted = 0
    while True:
        status = await pool.execute(
            """DELETE FROM lanes_processed WHERE ctid IN (
                   SELECT ctid FROM lanes_processed
                   WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2) LIMIT $3)""",
            consumer,
            retention_s,
            _PRUNE_CHUNK,
        )
        count = int(status.rsplit(" ", 1)[-1])
        deleted += count
        if count < _PRUNE_CHUNK:
            return deleted


_VERIFY_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lanes-verify")
_SHARED_FROM = 16
"""A batch this large verifies half on `_VERIFY_THREAD`: libsodium lets go of the GIL while it checks a
signature, so two cores verify at once (bench/telemetry.py --signed). A smaller batch is not worth the hop."""


async def _decoded_batch(msgs: Sequence[Msg], keyring: Keyring | None) -> list[_Item]:
    """Each message verified (with a keyring) and decoded, in order."""
    if keyring is None or len(msgs) < _SHARED_FROM:
        return [_decoded(msg, keyring) for msg in msgs]
    half = len(msgs) // 2
    second = asyncio.get_running_loop().run_in_executor(_VERIFY_THREAD, _decoded_all, msgs[half:], keyring)
    return _decoded_all(msgs[:half], keyring) + await second


def _decoded_all(msgs: Sequence[Msg], keyring: Keyring | None) -> list[_Item]:
    return [_decoded(msg, keyring) for msg in msgs]


def _decoded(msg: Msg, keyring: Keyring | None = None) -> _Item:
    if keyring is not None:
        try:
            verified_signer(msg.subject, msg.headers, msg.data, keyring)
        except SignatureError as exc:
            reason = f"forged: {exc}"
            log.warning("forged event refused", subject=msg.subject, reason=reason)
            return _Item(msg, None, reason)
    try:
        return _Item(msg, decode(msg.subject, msg.headers, msg.data))
    except DecodeError as exc:
        return _Item(msg, None, str(exc))


def _key_of(subject: str) -> str:
    """The ordering key of a subject: its entity token (`lanes.job.<job>.<name>` -> the job)."""
    parts = subject.split(".")
    return parts[2] if len(parts) > 3 else subject  # noqa: PLR2004 - lanes.<family>.<key>.<name>


def _reason(outcome: decision.Outcome) -> str:
    return str(getattr(outcome, "reason", type(outcome).__name__))


async def record_only(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """A handler with no effect beyond the processed-event record (services that only observe, for now)."""
    del event, ctx
    return ()
