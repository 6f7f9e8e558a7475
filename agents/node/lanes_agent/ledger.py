"""The agent's ledger: every rank it has started, on disk, so that each rank runs at most once.

A placement comes back to the agent more than once: JetStream redelivers it after an outage outlasted its
ack wait, or after the agent itself was killed. Without a record on disk the agent cannot tell "never
started" from "started by my earlier self", and runs the rank again, possibly on GPUs already handed back.

So the agent writes a rank's record *before* it starts the process (an intent), then its pid, then its exit.
A restarted agent reads the records its earlier self left unfinished and settles them (`reclaim`): a rank
still running is killed (nothing reads its output any more, and its gang has moved on), one already gone is
reported lost. A redelivered placement then finds every rank's record finished and reports what is missing.

The record also says which of the rank's own events (its start, its exit, the agent's fault) the log already
holds: written before each publish (`sent`) and after JetStream acknowledges it (`stored`). A later run, however
much later, never publishes a stored one again; JetStream's duplicate window only covers minutes.

Records are keyed by the placement's event id, which no other placement shares, so a fresh bus (a new `lanes
up`) never meets an old record of a job of the same name. Each write replaces the file atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

RETENTION_S = 7 * 24 * 3600.0
"""Finished records are kept a week: far beyond any redelivery of their placement."""


@dataclass(frozen=True)
class RankRecord:
    """What the agent knows about one rank of one placement."""

    placement: str
    """The id of the `placed` event that assigned the rank."""
    rank: int
    job_id: str
    attempt: int
    node: str
    incarnation: str
    """Which run of the agent started it: a record of another incarnation is an earlier self's."""
    pid: int | None = None
    """None: the agent meant to start it and may have died before (or while) doing so."""
    pid_start: int | None = None
    """The process's start time (clock ticks since boot): tells the rank from a later process given its pid."""
    evidence: int = 0
    """Evidence events published from its output so far."""
    exit: dict[str, Any] | None = None
    """Its `RankExitedData` (as JSON) once it has ended."""
    sent: tuple[str, ...] = ()
    """Ids of the rank's events whose publishing began: one not `stored` too may or may not be on the log."""
    stored: tuple[str, ...] = ()
    """Ids of the rank's events the log holds (JetStream acknowledged them, or they were found there)."""

    @property
    def key(self) -> str:
        """The record's file name."""
        return f"{self.placement}.r{self.rank}"

    def sending(self, event_id: str) -> RankRecord:
        """The record once the publishing of event `event_id` has begun."""
        return self if event_id in self.sent else replace(self, sent=(*self.sent, event_id))

    def holding(self, event_id: str) -> RankRecord:
        """The record once the log is known to hold event `event_id`."""
        return self if event_id in self.stored else replace(self, stored=(*self.stored, event_id))


class RankLedger:
    """One JSON file per rank under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def get(self, placement: str, rank: int) -> RankRecord | None:
        """The rank's record, or None when this agent never meant to start it."""
        return self._read(self.directory / f"{placement}.r{rank}.json")

    def put(self, record: RankRecord) -> RankRecord:
        """Store the record durably (write, fsync, rename): a crash leaves the old record or the new one."""
        path = self.directory / f"{record.key}.json"
        temporary = path.with_suffix(".tmp")
        with temporary.open("w") as file:
            json.dump(asdict(record), file)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(path)
        return record

    def unfinished(self) -> list[RankRecord]:
        """Every record without an exit: ranks that may still be running."""
        return [r for r in map(self._read, sorted(self.directory.glob("*.json"))) if r is not None and r.exit is None]

    def prune(self, older_than_s: float = RETENTION_S) -> int:
        """Forget finished records last written more than `older_than_s` ago; returns how many."""
        cutoff = time.time() - older_than_s
        pruned = 0
        for path in self.directory.glob("*.json"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff and (record := self._read(path)) is not None and record.exit:
                    path.unlink()
                    pruned += 1
        return pruned

    @staticmethod
    def _read(path: Path) -> RankRecord | None:
        try:
            fields = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        # JSON gives lists; a record written before the agent kept them has none.
        return RankRecord(**fields | {name: tuple(fields.get(name, ())) for name in ("sent", "stored")})


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22), or None if it is gone.

    A zombie is gone: it has ended and only waits for its parent (init, for an orphan) to reap it.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count the fields after its last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in {"Z", "X"} else int(fields[19])


def still_running(record: RankRecord) -> bool:
    """Whether the record's process is alive: its pid exists and started when the record says."""
    return record.pid is not None and process_start(record.pid) == record.pid_start


def reclaim(record: RankRecord, *, wait_s: float = 5.0) -> RankRecord:
    """Settle a rank an earlier incarnation left unfinished: kill it if it still runs, and record it as lost.

    Its own exit status went with the agent that started it, so the exit says what is known instead.
    """
    if record.pid is None:
        lost = "the agent restarted while starting this rank; it may have run, it will not be started again"
    elif still_running(record):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.pid, signal.SIGKILL)  # the rank leads its own group: its workers go too
        deadline = time.monotonic() + wait_s
        while still_running(record) and time.monotonic() < deadline:
            time.sleep(0.05)  # an orphan is reaped by init, not by us: wait for its /proc entry to go
        lost = f"the agent restarted while this rank (pid {record.pid}) ran; nothing read its output, so it was killed"
    else:
        lost = f"the agent restarted while this rank (pid {record.pid}) ran; it had exited, with a status now unknown"
    exit_data = {"exit_code": None, "signal": None, "evidence": record.evidence + 1, "lost": lost}
    return replace(record, exit=exit_data)
