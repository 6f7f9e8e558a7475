"""The node agent's kernel-log follower: Xid, OOM-kill, ECC and link lines as evidence, each read once.

It keeps its position (boot id and sequence number) after each record, so a line written while the agent was
down is read after its restart and none is read twice; while the bus is away it keeps draining the kernel's
ring into a bounded backlog, so the ring cannot overwrite what it has not read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog

from lanes_agent import kmsg
from lanes_agent.ledger import RankRecord
from lanes_contract.events import Event, EvidenceCategory, EvidenceData, PlatformEvidence
from lanes_contract.ids import derived_event_id
from lanes_contract.streams import TELEMETRY
from lanes_evidence.evidence import Evidence, evidence_event

log = structlog.get_logger(__name__)

Publish = Callable[[Event, str], Awaitable[None]]
"""Publish an event on a stream (`held`: through outages, until stored; otherwise once, or fail)."""

_KERNEL_LOG_POLL_S = 0.2
_KERNEL_BACKLOG = 10_000
"""Kernel records read but not yet published, at most. While the bus is away the follower keeps draining the
kernel's ring buffer (which overwrites its oldest records) into memory; past this many, the ring keeps the rest."""


class KernelLogFollower:
    """Follows one kernel log (`/dev/kmsg`) for an agent's nodes."""

    def __init__(
        self,
        path: Path,
        position_file: Path | None,
        nodes: frozenset[str],
        ranks_by_pid: Mapping[int, RankRecord],
        *,
        publish_held: Publish,
        publish_now: Publish,
    ) -> None:
        self._path = path
        self._position_file = position_file
        self._nodes = nodes
        self._ranks_by_pid = ranks_by_pid
        """The ranks the agent (or its earlier self) started, by pid: whose process a kernel line names."""
        self._publish_held = publish_held
        self._publish_now = publish_now
        self.state = "following"
        """What the agent's heartbeat says of its kernel log: following, or why it cannot."""

    async def follow(self, stop: asyncio.Event) -> None:
        """Publish the kernel lines that are evidence (Xid, OOM kill, ECC, link), from a stored position on.

        A line that names the pid of a rank this agent started is that rank's (job, attempt, rank, node);
        one that names none is the node's, when this agent runs one node, and otherwise attributed to no
        simulated node (they all share this kernel). When the log cannot be read, each node says so.
        """
        path = self._path
        boot = kmsg.boot_id()
        position = None if self._position_file is None else kmsg.Position.load(self._position_file)
        try:
            reader = kmsg.KmsgReader(path, position, boot)
        except OSError as exc:
            await self._unreadable(exc)
            return
        booted = kmsg.boot_time()
        backlog: asyncio.Queue[kmsg.KmsgRecord] = asyncio.Queue(maxsize=_KERNEL_BACKLOG)
        publisher = asyncio.create_task(self._publish_records(backlog, boot, booted))
        overwritten = 0
        try:
            while not stop.is_set():
                for record in reader.available():
                    await backlog.put(record)  # waits while the backlog is full: the ring holds the rest
                if reader.lost > overwritten:
                    log.warning("kernel log records overwritten before they were read", lost=reader.lost - overwritten)
                    overwritten = reader.lost
                await asyncio.sleep(_KERNEL_LOG_POLL_S)
        except OSError as exc:
            await self._unreadable(exc)
        except Exception:
            log.exception("kernel log follower failed")
            raise
        finally:
            # What is still in the backlog was never marked handled: the next run reads it again from the ring.
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
            reader.close()

    async def _publish_records(self, backlog: asyncio.Queue[kmsg.KmsgRecord], boot: str, booted: datetime) -> None:
        """Publish the backlog's records in order, each held through outages, and store the position after each.

        An outage holds the record at the head (one warning when it starts, one line when it ends); a record
        the bus refuses for another reason is skipped with a warning, so one bad line never ends the follower.
        """
        while True:
            record = await backlog.get()
            try:
                await self._record(record, boot, booted)
            except Exception as exc:  # noqa: BLE001 - refused, not an outage: retrying would refuse it forever
                log.warning("kernel line not published", sequence=record.sequence, error=f"{type(exc).__name__}: {exc}")
            if self._position_file is not None:
                try:
                    kmsg.Position(boot, record.sequence).save(self._position_file)
                except OSError as exc:  # the next run re-reads from the older position; ids dedupe what it repeats
                    log.warning("kernel log position not stored", error=exc.strerror or str(exc))

    async def _record(self, record: kmsg.KmsgRecord, boot: str, booted: datetime) -> None:
        data = kmsg.kernel_evidence(record)
        if data is None:
            return
        owner = self._ranks_by_pid.get(data.pid) if data.pid is not None else None
        if owner is None and len(self._nodes) != 1:
            log.info("kernel line names no rank of this agent; not attributed", line=record.text[:200])
            return
        node = owner.node if owner else next(iter(self._nodes))
        at = booted + record.since_boot
        event = evidence_event(Evidence(data=data, time=at, node=node), source=f"agent/{node}", node=node, time=at)
        update: dict[str, Any] = {"id": derived_event_id(f"kmsg/{boot}", event.type, str(record.sequence))}
        if owner is not None:
            update |= {"jobid": owner.job_id, "attempt": owner.attempt, "rank": owner.rank}
        await self._publish_held(event.model_copy(update=update), TELEMETRY.name)

    async def _unreadable(self, exc: OSError) -> None:
        """Say on each node's evidence that its kernel evidence will be missing, and why."""
        reason = f"kernel log {self._path} unreadable: {exc.strerror or exc}"
        self.state = reason
        log.warning("agent cannot read the kernel log; kernel evidence will be missing", reason=reason)
        for node in sorted(self._nodes):
            data = EvidenceData(category=EvidenceCategory.RAW, summary=reason, origin="agent")
            said = PlatformEvidence(source=f"agent/{node}", node=node, data=data)
            try:
                await self._publish_now(said, TELEMETRY.name)
            except Exception as failed:  # noqa: BLE001 - the agent keeps running its ranks without the bus too
                log.warning("cannot report the unreadable kernel log", node=node, error=str(failed))
