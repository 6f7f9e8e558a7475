"""Durable consumers that come back: a consumer deleted or bent by someone else is restored where it was.

A service reads through one durable consumer, and a durable lives on the NATS server, where anyone with the
right (the admin, an identity that kept `$JS.API.>`) may delete it or change its configuration. Without
upkeep the service then fails every fetch ("pull request refused: 503") and never takes another event, or
takes a filter that matches nothing and leaves jobs queued forever.

`DurableUpkeep` checks the durable every CHECK_EVERY_S, off the hot path (one consumer-info request, and a
write when the ack floor moved):

- In order, it records the consumer's ack floor (`FloorStore`: `lanes_consumer_floors` in PostgreSQL for the
  services and the audit recorder, a file in its state directory for a node agent, which has no database):
  every message at or below it was committed and acknowledged. Only a floor read from a durable that matches
  its spec is recorded, and a recorded floor only rises (a replica's late write of an older reading is a
  smaller, still true, floor).
- Missing, or drifted in what decides which messages it delivers (filter subjects, ack policy, start
  position, push delivery, paused, ...): it is deleted if need be and created again, starting right after
  the recorded floor (`DeliverPolicy.BY_START_SEQUENCE`). Starting at the start of the stream would apply
  again events whose processed records were pruned; starting at the end would lose the backlog. A filter
  is never fixed in place: while it was wrong, the server moved the durable past the messages it hid.
- Drifted only in how hard it retries (ack wait, max deliveries, max ack pending): updated in place, which
  keeps its position.

Why starting after the recorded floor loses nothing and applies nothing twice: everything at or below it was
processed. Messages above it that were processed before the durable vanished come back once more, and
their processed records (`lanes_processed`) make them duplicates: a record is kept for `spec.retention_s`
(the duplicate window plus the whole redelivery horizon, minutes), while a message above the floor was
processed at most that horizon before the floor passed it, and the floor recorded here lags the server's
by at most CHECK_EVERY_S, plus the CHECK_EVERY_S it takes to notice the loss: seconds, well inside the
duplicate window alone. An ordered consumer (`ConsumerSpec.ordered`) folds only staged events at or below
the ack floor; a recreated durable's floor starts at the recorded one, at or below every floor it had, so
the fold waits for the redelivered duplicates to raise it again and never skips or reorders (docs/ordering.md).

While the durable is missing or drifted, the consumer is not ready (`Readiness`, the one place readiness
changes); it logs one warning for what it found and one line for what it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import asyncpg
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy, ReplayPolicy
from nats.js.errors import APIError, NotFoundError

from lanes_runtime.failures import is_infrastructure
from lanes_runtime.health import Readiness, describe

if TYPE_CHECKING:
    from lanes_runtime.consumer import ConsumerSpec

CHECK_EVERY_S = 3.0
"""Pause between two checks of a durable: how long a lost durable may go unnoticed (its fetches fail meanwhile,
so the consumer is already not ready)."""
_DURABLE = "durable"
"""The cause a missing or drifted durable reports to the consumer's readiness."""
_IN_PLACE = ("ack_wait", "max_deliver", "max_ack_pending")
"""Fields the server updates on a live durable, keeping its position."""
_DELIVERY = ("deliver_subject", "headers_only", "backoff", "rate_limit_bps", "inactive_threshold")
"""Fields whose change alters what is delivered, or to whom: the durable is made again (unset in the spec)."""


@dataclass(frozen=True)
class Floor:
    """The last ack floor recorded for a durable, and the stream (by its creation time) it belongs to."""

    ack_floor: int
    stream_created: dt.datetime | None


class FloorStore(Protocol):
    """Where the ack floors of durables are recorded, so a lost durable is made again right after its floor."""

    async def recorded(self, durable: str) -> Floor | None:
        """The floor last recorded for `durable` (None: never recorded)."""
        ...

    async def record(self, durable: str, stream: str, floor: Floor) -> int:
        """Record a floor read from the server; return the floor now recorded.

        A recorded floor of the same stream (by creation time) only rises; one of another stream replaces it.
        """
        ...

    def restoring(self, durable: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Held while a durable is restored: two replicas never restore the same durable at once."""
        ...


class PostgresFloors:
    """Floors in `lanes_consumer_floors` (a runtime migration): shared by a service's replicas."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def recorded(self, durable: str) -> Floor | None:
        """The floor last recorded for `durable` (None: never recorded)."""
        row = await self._pool.fetchrow(
            "SELECT ack_floor, stream_created FROM lanes_consumer_floors WHERE consumer = $1", durable
        )
        return Floor(int(row["ack_floor"]), row["stream_created"]) if row is not None else None

    async def record(self, durable: str, stream: str, floor: Floor) -> int:
        """Record `floor` in one statement (it only rises for the same stream); return the floor recorded."""
        recorded = await self._pool.fetchval(
            """INSERT INTO lanes_consumer_floors (consumer, stream, stream_created, ack_floor) VALUES ($1, $2, $3, $4)
               ON CONFLICT (consumer) DO UPDATE SET
                   stream = EXCLUDED.stream, stream_created = EXCLUDED.stream_created, recorded_at = now(),
                   ack_floor = CASE
                       WHEN lanes_consumer_floors.stream_created IS NOT DISTINCT FROM EXCLUDED.stream_created
                       THEN GREATEST(lanes_consumer_floors.ack_floor, EXCLUDED.ack_floor)
                       ELSE EXCLUDED.ack_floor END
               RETURNING ack_floor""",
            durable,
            stream,
            floor.stream_created,
            floor.ack_floor,
        )
        return int(recorded)

    @contextlib.asynccontextmanager
    async def restoring(self, durable: str) -> AsyncIterator[None]:
        """A transaction holding an advisory lock on the durable's name: one replica restores at a time."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('lanes_upkeep'), hashtext($1))", durable)
            yield


class FileFloors:
    """Floors as one small JSON file per durable in a directory: for a node agent, which has no database.

    One agent runs per state directory, so restoring needs no lock. A file is replaced whole (written beside
    it, then renamed): a crash leaves the old floor or the new one, never half of one.
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory

    def _path(self, durable: str) -> Path:
        return self._directory / f"{durable}.floor.json"

    async def recorded(self, durable: str) -> Floor | None:
        """The floor in the durable's file (None: no file, or one that cannot be read)."""
        try:
            raw = json.loads(self._path(durable).read_text())
            created = raw["stream_created"]
            return Floor(int(raw["ack_floor"]), dt.datetime.fromisoformat(created) if created else None)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Unreadable: as if never recorded (a lost durable then starts over), and said once per read.
            structlog.get_logger(__name__).warning("ack floor file unreadable", durable=durable, error=str(exc))
            return None

    async def record(self, durable: str, stream: str, floor: Floor) -> int:
        """Replace the durable's file (the floor only rises for the same stream); return the floor recorded."""
        held = await self.recorded(durable)
        if held is not None and held.stream_created == floor.stream_created:
            floor = dataclasses.replace(floor, ack_floor=max(held.ack_floor, floor.ack_floor))
        created = floor.stream_created.isoformat() if floor.stream_created else None
        body = json.dumps({"stream": stream, "stream_created": created, "ack_floor": floor.ack_floor})
        self._directory.mkdir(parents=True, exist_ok=True)
        partial = self._path(durable).with_suffix(".partial")
        partial.write_text(body)
        partial.replace(self._path(durable))
        return floor.ack_floor

    @contextlib.asynccontextmanager
    async def restoring(self, durable: str) -> AsyncIterator[None]:
        """Nothing to hold: one agent per state directory."""
        del durable
        yield


@dataclass(frozen=True)
class Drift:
    """How a live durable differs from its spec: what must be made again, and what can be updated in place."""

    remake: tuple[str, ...] = ()
    update: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.remake or self.update)

    def describe(self) -> str:
        """The differing fields, for a log line."""
        return ", ".join((*self.remake, *self.update))


def drift_of(spec: ConsumerSpec, info: ConsumerInfo, floor: Floor | None, *, policy: str | None = None) -> Drift:
    """How the durable `info` describes differs from `spec` (pure).

    `policy` is the durable's priority policy, read for a pinned spec only (nats-py's info does not carry it):
    a pinned spec's durable without a pinned client would refuse every pull naming its group, so it is made
    again (a policy cannot change on a live durable).

    A durable that starts at the start of the stream with an ack floor below the recorded one was made
    again by someone else: it is delivering the whole stream again. One that starts past the recorded floor
    skipped messages. Both are made again from the floor.
    """
    want, have = spec.config(), info.config
    remake: list[str] = []
    if sorted(_filters(have)) != sorted(spec.subjects):
        remake.append("filter_subjects")
    if have.ack_policy != AckPolicy.EXPLICIT:
        remake.append("ack_policy")
    if (have.replay_policy or ReplayPolicy.INSTANT) != ReplayPolicy.INSTANT:
        remake.append("replay_policy")
    remake += [name for name in _DELIVERY if (getattr(have, name) or None) != (getattr(want, name) or None)]
    if info.paused:
        remake.append("paused")
    if spec.pinned_s is not None and policy != PINNED_CLIENT:
        remake.append("priority_policy")
    acked = int(info.ack_floor.stream_seq) if info.ack_floor else 0
    match have.deliver_policy:
        case DeliverPolicy.ALL if floor is not None and acked < floor.ack_floor:
            remake.append("deliver_policy (started over from the start of the stream)")
        case DeliverPolicy.ALL:
            pass
        case DeliverPolicy.BY_START_SEQUENCE if floor is not None and (have.opt_start_seq or 0) > floor.ack_floor + 1:
            remake.append("opt_start_seq (starts past the recorded ack floor)")
        case DeliverPolicy.BY_START_SEQUENCE:
            pass
        case _:
            remake.append("deliver_policy")
    update = tuple(name for name in _IN_PLACE if not _same(getattr(have, name), getattr(want, name)))
    return Drift(tuple(remake), update)


def _filters(config: ConsumerConfig) -> list[str]:
    if config.filter_subjects:
        return list(config.filter_subjects)
    return [config.filter_subject] if config.filter_subject else []


def _same(have: object, want: object) -> bool:
    if isinstance(have, float | int) and isinstance(want, float | int):
        return abs(have - want) < 1e-3  # noqa: PLR2004 - ack wait travels as nanoseconds
    return have == want


class DurableUpkeep:
    """Keeps one consumer's durable present and as its spec says, and records its ack floor meanwhile."""

    def __init__(
        self,
        js: JetStreamContext,
        floors: FloorStore,
        spec: ConsumerSpec,
        readiness: Readiness,
    ) -> None:
        self._js = js
        self._floors = floors
        self._spec = spec
        self._readiness = readiness
        # Bound from a fresh logger, not the module's: a logger used once keeps the logging configuration of that
        # moment, and a process (a test run, an in-process `lanes` command) may configure logging again.
        self._log = structlog.get_logger(__name__).bind(consumer=spec.durable, stream=spec.stream.name)
        self._recorded: int | None = None
        """The floor this process last recorded (a write is skipped when the floor has not moved)."""
        self._last_error: str | None = None
        self._policy: str | None = None
        """The durable's priority policy when last read (read for a pinned spec only)."""
        self._stream_created: dt.datetime | None = None
        """When the stream was created, read once (a stream made again takes its durables with it: restored,
        and read again then)."""

    async def provision(self) -> None:
        """Create the durable, restore it, or bring it to its spec; record its ack floor (at start-up).

        A durable never created (no recorded floor) starts at the start of the stream; one that disappeared
        while the service was away starts right after its recorded floor.
        """
        await self.check()

    @contextlib.asynccontextmanager
    async def kept(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """Within the block, the durable is checked every CHECK_EVERY_S until `stop` is set."""
        task = asyncio.create_task(self._keep(stop), name=f"lanes-upkeep-{self._spec.durable}")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _keep(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=CHECK_EVERY_S)
            if stop.is_set():
                return
            try:
                await self.check()
            except Exception as exc:  # noqa: BLE001 - checked again at the next turn; the failure is logged once
                # A bus that is away already shows in the fetches (not ready, logged there).
                error = describe(exc)
                if not is_infrastructure(exc) and error != self._last_error:
                    self._log.warning("cannot check the durable consumer; trying again", error=error)
                self._last_error = error
            else:
                self._last_error = None

    async def check(self) -> None:
        """One turn: record the floor of a durable that matches its spec, or restore one that does not."""
        info = await self._info()
        floor = await self._floor() if info is None or self._recorded is None else Floor(self._recorded, None)
        if info is not None and not (drift := drift_of(self._spec, info, floor, policy=self._policy)):
            await self._record(info)
            self._readiness.answered(_DURABLE)
            return
        if info is None and floor is None:
            await self._create(None)  # the first start of this consumer: nothing to restore
            self._log.info("durable consumer created", start="the start of the stream")
            await self._record(await self._info())
            return
        found = "missing" if info is None else f"changed ({drift.describe()})"
        self._log.warning("durable consumer not as its spec says; restoring it", found=found)
        self._readiness.unavailable(_DURABLE, f"durable consumer {self._spec.durable} {found}")
        did = await self._restore()
        self._log.info("durable consumer restored", did=did)
        self._readiness.answered(_DURABLE)

    async def _restore(self) -> str:
        """Look again under a lock (another replica may have restored it meanwhile), and restore; say how."""
        self._stream_created = None
        async with self._floors.restoring(self._spec.durable):
            info = await self._info()
            floor = await self._floor()
            drift = drift_of(self._spec, info, floor, policy=self._policy) if info is not None else None
            if info is not None and not drift:
                did = "nothing: already restored by another replica"
            elif info is not None and drift is not None and not drift.remake:
                # The start position cannot change on a live durable: the update keeps the one it has.
                config = dataclasses.replace(
                    self._spec.config(),
                    deliver_policy=info.config.deliver_policy,
                    opt_start_seq=info.config.opt_start_seq,
                )
                await self._add(config)
                did = f"updated in place ({drift.describe()})"
            else:
                if info is not None:
                    with contextlib.suppress(NotFoundError):
                        await self._js.delete_consumer(self._spec.stream.name, self._spec.durable)
                start = await self._create(floor)
                did = f"recreated from stream sequence {start}" if start else "recreated from the start of the stream"
        await self._record(await self._info())
        return did

    async def _create(self, floor: Floor | None) -> int | None:
        """Create the durable after `floor` (a floor of another stream, or none: from the start); its start."""
        config = self._spec.config()
        start = None
        if floor is not None and await self._same_stream(floor):
            start = floor.ack_floor + 1
            config = dataclasses.replace(config, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        await self._add(config)
        return start

    async def _add(self, config: ConsumerConfig) -> None:
        """Create or update the durable with `config`.

        A pinned one by the JetStream API's own request: nats-py's config has no priority groups, and an update
        without them would be refused.
        """
        if self._spec.pinned_s is None:
            await self._js.add_consumer(self._spec.stream.name, config=config)
            return
        subject = f"$JS.API.CONSUMER.CREATE.{self._spec.stream.name}.{self._spec.durable}"
        reply = await self._js._nc.request(  # noqa: SLF001 - the context's connection, for a raw API request
            subject, json.dumps(self._spec.create_request(config)).encode(), timeout=_API_TIMEOUT_S
        )
        answer = json.loads(reply.data)
        if "error" in answer:
            raise APIError.from_error(answer["error"])

    async def _same_stream(self, floor: Floor) -> bool:
        created = (await self._js.stream_info(self._spec.stream.name)).created
        if floor.stream_created is None or created is None:
            return True
        return abs((created - floor.stream_created).total_seconds()) < 1e-3  # noqa: PLR2004 - microseconds stored

    async def ack_floor(self) -> int:
        """The durable's ack floor; 0 while it is missing (nothing is folded until it is restored, by `check`).

        A missing durable is not a failure of the fold that asked: the fold waits, as for any gap.
        """
        info = await self._info()
        return int(info.ack_floor.stream_seq) if info is not None and info.ack_floor else 0

    async def _info(self) -> ConsumerInfo | None:
        try:
            if self._spec.pinned_s is not None:
                return await self._raw_info()
            info: ConsumerInfo = await self._js.consumer_info(self._spec.stream.name, self._spec.durable)
        except NotFoundError as exc:
            if exc.err_code == _STREAM_NOT_FOUND:
                raise
            return None
        return info

    async def _raw_info(self) -> ConsumerInfo:
        """The durable's info by the API's own request, keeping its priority policy (`_policy`) nats-py drops."""
        subject = f"$JS.API.CONSUMER.INFO.{self._spec.stream.name}.{self._spec.durable}"
        reply = await self._js._nc.request(subject, b"", timeout=_API_TIMEOUT_S)  # noqa: SLF001 - see _add
        answer = json.loads(reply.data)
        if "error" in answer:
            raise APIError.from_error(answer["error"])
        self._policy = answer.get("config", {}).get("priority_policy")
        info: ConsumerInfo = ConsumerInfo.from_response(answer)
        return info

    async def _floor(self) -> Floor | None:
        return await self._floors.recorded(self._spec.durable)

    async def _record(self, info: ConsumerInfo | None) -> None:
        """Record the floor of a durable that matches its spec (a recorded floor of the same stream only rises)."""
        acked = int(info.ack_floor.stream_seq) if info is not None and info.ack_floor else 0
        if info is None or acked == self._recorded:
            return
        if self._stream_created is None:
            self._stream_created = (await self._js.stream_info(self._spec.stream.name)).created
        floor = Floor(acked, self._stream_created)
        self._recorded = await self._floors.record(self._spec.durable, self._spec.stream.name, floor)


PINNED_CLIENT = "pinned_client"
_API_TIMEOUT_S = 5.0
"""How long a consumer's creation may take to be answered (a cluster's consumer leader is elected first)."""
_STREAM_NOT_FOUND = 10059
"""JetStream's error code for a stream that does not exist (a missing consumer is 10014)."""
