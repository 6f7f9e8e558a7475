"""The audit recorder: copies every message of the jobs stream, in order, into the hash-chained table.

It does not use the services' event consumer on purpose: an audit copy must hold every stored message,
including those no service could decode (which the contract dead-letters), byte for byte. It shares the
runtime's fetch loop and outage hold (`lanes_runtime.delivery`) and keeps the contract's guarantees its own
way: a durable pull consumer with explicit acks; a fetched batch is appended
in one transaction and acknowledged only after commit; a redelivered message at or below the chain head is
already recorded and is acknowledged without a second link.

The chain never skips: LANES_JOBS denies deletes, so its sequences are contiguous, and a message is
appended only right after the chain head (stream sequence head + 1). A message past a gap (an earlier one
is still out for redelivery) is sent back to wait for the gap to fill, never appended over it. An outage
(PostgreSQL or NATS unavailable) holds the batch in place with backoff, as the consumer runtime does;
any other error sends the batch back. There is no max_deliver: the copy may stall, loudly, but never skip.

A gap that has not filled after LANES_AUDIT_GAP_BOUND_S (60 s) is no longer a redelivery on its way: the
recorder turns not ready and logs which sequences it lacks (rows deleted from the table after they were
acknowledged never come back; `lanes audit verify` names them as missing and the recorder as stalled).

Its durable is kept as the services' are (`lanes_runtime.upkeep`): deleted or re-filtered by someone else, it
is made again right after its recorded ack floor, so a message the copy lacks comes back (those already
in the chain are acknowledged again without a link).

It reports as the services' consumers do: the `lanes_consumer_*` metrics under its durable name (links
appended count as processed, messages already recorded as duplicates, those sent back as retries), and a
readiness that the runtime's database probe and outage hold keep (`lanes_runtime.health`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import asyncpg
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig

from lanes_audit.adapters import repository
from lanes_audit.adapters.signing import Signer
from lanes_audit.domain.chain import RECORDER_DURABLE, Link, canonical_bytes, link_hash
from lanes_contract.streams import AUDIT, JOBS
from lanes_runtime.consumer import ConsumerSpec, Outcome
from lanes_runtime.delivery import BatchPull, hold_through_outages, pull_batches, settle
from lanes_runtime.health import DatabaseWatch, Readiness
from lanes_runtime.metrics import ConsumerMetrics
from lanes_runtime.upkeep import DurableUpkeep, PostgresFloors


def _log() -> structlog.typing.FilteringBoundLogger:
    """This module's logger, looked up at each line (a logger used once is cached with that moment's set-up)."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(__name__)
    return logger


RETRY_DELAY_S = 1.0


def recorder_spec(durable: str = RECORDER_DURABLE) -> ConsumerSpec:
    """Every message of the jobs stream, from the first, acknowledged one by one, never given up on.

    The recorder runs its own loop; the spec gives the durable's configuration, its upkeep, and the backoff
    and ack wait of the runtime's outage hold.
    """
    return ConsumerSpec(
        durable=durable, stream=JOBS, subjects=JOBS.subjects, max_deliver=-1, ack_wait_s=60.0, max_ack_pending=2000
    )


GAP_BOUND_ENV = "LANES_AUDIT_GAP_BOUND_S"
DEFAULT_GAP_BOUND_S = 60.0
_GAP = "gap"
"""The readiness cause of a gap waited on for longer than the bound."""


def gap_bound_from_env() -> float:
    """LANES_AUDIT_GAP_BOUND_S: seconds a gap may wait to fill before the recorder turns not ready."""
    text = os.environ.get(GAP_BOUND_ENV)
    if text is None:
        return DEFAULT_GAP_BOUND_S
    try:
        bound = float(text)
    except ValueError:
        bound = -1.0
    if not 0 < bound < float("inf"):
        msg = f"{GAP_BOUND_ENV} must be a positive number of seconds, not {text!r}"
        raise ValueError(msg)
    return bound


class AuditRecorder:
    """Appends the jobs stream to the audit chain and signs a checkpoint every `checkpoint_every` links."""

    def __init__(
        self,
        nc: NatsClient,
        pool: asyncpg.Pool,
        *,
        signer: Signer | None = None,
        checkpoint_every: int = 1000,
        durable: str = RECORDER_DURABLE,
        gap_bound_s: float | None = None,
    ) -> None:
        self.name = durable
        self._nc = nc
        self._js = nc.jetstream()
        self._pool = pool
        self._signer = signer or Signer.from_env()
        self._checkpoint_every = checkpoint_every
        self.recorded = 0
        self._metrics = ConsumerMetrics.for_consumer(durable)
        self._readiness = Readiness(durable, self._metrics.ready)
        self._spec = recorder_spec(durable)
        self._upkeep = DurableUpkeep(self._js, PostgresFloors(pool), self._spec, self._readiness)
        self._gap_bound_s = gap_bound_from_env() if gap_bound_s is None else gap_bound_s
        self._gap: tuple[int, float] | None = None
        """The chain head a gap after it was first seen at, and when (monotonic)."""
        self._stuck = False

    @property
    def ready(self) -> bool:
        """True from the start; False while a server is away or a gap outwaits its bound, and once it failed."""
        return self._readiness.ready

    def config(self) -> ConsumerConfig:
        """Every message of the jobs stream, from the first, acknowledged one by one."""
        return self._spec.config()

    async def provision(self) -> None:
        """Create the durable, or restore it after its recorded ack floor, or bring it to its spec."""
        await self._upkeep.provision()

    async def run(self, stop: asyncio.Event) -> None:
        """Record batches until `stop` is set; a failure that ends the loop makes it not ready for good."""
        with self._readiness.failing_for_good():
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        await self.provision()
        sub = await BatchPull.bind(self._nc, JOBS.name, self.name)
        try:
            async with DatabaseWatch.watching(self._pool, self._readiness), self._upkeep.kept(stop):
                async for msgs in pull_batches(sub, 500, stop, consumer=self.name, readiness=self._readiness):
                    if msgs:
                        await self.record(msgs)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def record(self, msgs: list[Msg]) -> None:
        """Append a batch's contiguous run in one transaction, then acknowledge it; send back what waits."""
        ordered = sorted(msgs, key=lambda m: m.metadata.sequence.stream)
        self._metrics.batch_size.observe(len(ordered))
        self._metrics.pending.set(ordered[-1].metadata.num_pending or 0)

        def on_hold(_: Exception, __: float) -> None:
            self._metrics.held.inc(len(ordered))

        try:
            head_seq, appended = await hold_through_outages(
                lambda: self._append_signed(ordered),
                self._spec,
                held=ordered,
                on_hold=on_hold,
                readiness=self._readiness,
            )
        except Exception as exc:  # noqa: BLE001 - nothing was committed: send the batch back
            _log().warning("audit batch failed; redelivering", error=f"{type(exc).__name__}: {exc}", size=len(msgs))
            await self._send_back(ordered)
            return
        recorded = [m for m in ordered if m.metadata.sequence.stream <= head_seq]
        for msg in recorded:
            await settle(msg.ack())  # a lost ack means a redelivery, which is recognised
        self._metrics.count(Outcome.PROCESSED, appended)
        self._metrics.count(Outcome.DUPLICATE, len(recorded) - appended)  # recorded before a lost ack or a crash
        waiting = ordered[len(recorded) :]
        if waiting:
            _log().info(
                "audit: waiting for a gap to fill",
                consumer=self.name,
                head=head_seq,
                next=waiting[0].metadata.sequence.stream,
            )
            await self._send_back(waiting)
        self._watch_gap(head_seq, waiting[0].metadata.sequence.stream if waiting else None)

    def _watch_gap(self, head_seq: int, next_seq: int | None) -> None:
        """Not ready once the same gap after the head has waited longer than the bound; ready again once it fills."""
        if self._gap is not None and self._gap[0] != head_seq:
            self._gap = None  # the head moved on: what the gap waited for has arrived
            if self._stuck:
                self._stuck = False
                _log().info("audit: the gap filled; recording again", consumer=self.name, head=head_seq)
                self._readiness.answered(_GAP)
        if next_seq is None:
            return
        if self._gap is None:
            self._gap = (head_seq, time.monotonic())
            return
        waited = time.monotonic() - self._gap[1]
        if not self._stuck and waited > self._gap_bound_s:
            self._stuck = True
            missing = f"{head_seq + 1}" if next_seq == head_seq + 2 else f"{head_seq + 1}-{next_seq - 1}"
            _log().error(
                "audit: stuck on a gap; these sequences never came back",
                consumer=self.name,
                missing=missing,
                head=head_seq,
                waited_s=round(waited, 1),
            )
            self._readiness.unavailable(_GAP, f"sequences {missing} missing after {waited:.0f} s")

    async def _send_back(self, msgs: list[Msg]) -> None:
        for msg in msgs:
            await settle(msg.nak(delay=RETRY_DELAY_S))
        self._metrics.count(Outcome.RETRY, len(msgs))

    async def _append_signed(self, msgs: list[Msg]) -> tuple[int, int]:
        """Append what follows the chain head and publish the checkpoints signed on the way.

        Returns the new head's stream sequence and how many links were appended.
        """
        started = time.perf_counter()
        head_seq, appended, checkpoints = await self._append(msgs)
        self._metrics.commit_seconds.observe(time.perf_counter() - started)
        for checkpoint in checkpoints:
            await self._publish_checkpoint(*checkpoint)
        return head_seq, appended

    async def _append(self, msgs: list[Msg]) -> tuple[int, int, list[tuple[int, bytes, bytes]]]:
        """Append the messages that follow the chain head without a gap.

        Returns the new head's stream sequence, how many links were appended and the checkpoints signed on
        the way.
        """
        async with self._pool.acquire() as conn, conn.transaction():
            await repository.lock_chain(conn)
            position, last_seq, previous = await repository.head(conn)
            if last_seq == 0:  # an empty chain starts at the stream's first message
                last_seq = await self._first_seq() - 1
            links: list[Link] = []
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                if seq <= last_seq:
                    continue  # recorded before a lost ack or a crash
                if seq != last_seq + 1:
                    break  # a gap: an earlier message has not come back yet
                canonical = canonical_bytes(JOBS.name, seq, msg.subject, msg.headers, msg.data)
                position += 1
                links.append(Link(position, seq, canonical, previous, link_hash(previous, canonical)))
                previous, last_seq = links[-1].hash, seq
            if not links:
                return last_seq, 0, []
            await repository.append(conn, JOBS.name, links)
            self.recorded += len(links)
            signed = []
            for mark in (link for link in links if link.position % self._checkpoint_every == 0):
                signature = self._signer.sign(mark.position, mark.hash)
                await repository.add_checkpoint(conn, mark.position, mark.hash, self._signer.public_key, signature)
                signed.append((mark.position, mark.hash, signature))
            return last_seq, len(links), signed

    async def _first_seq(self) -> int:
        info = await self._js.stream_info(JOBS.name)
        return int(info.state.first_seq or 1)

    async def _publish_checkpoint(self, position: int, chain_hash: bytes, signature: bytes) -> None:
        body = {
            "position": position,
            "hash": chain_hash.hex(),
            "public_key": self._signer.public_key.hex(),
            "signature": signature.hex(),
        }
        await self._js.publish(
            "lanes.audit.checkpoint",
            json.dumps(body).encode(),
            stream=AUDIT.name,
            headers={"Nats-Msg-Id": f"audit-checkpoint-{position}"},
        )
