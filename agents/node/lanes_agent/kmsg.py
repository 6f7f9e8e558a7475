"""The node's kernel log, read from /dev/kmsg: records with their sequence numbers, in wall time, resumable.

Each read of /dev/kmsg returns one record, `<priority>,<sequence>,<microseconds since boot>,<flags>;<text>`,
followed by optional continuation lines (` KEY=value`). The sequence number is the kernel's own and never
repeats within a boot, so a follower that stores the last one it handled (with the boot's id) resumes after a
restart without reading a line twice or skipping one the ring buffer still holds. Timestamps count from boot
on the monotonic clock; the wall time is the boot's wall time plus that offset.

Kernel lines become evidence through the same parser as every other log (`lanes_evidence.parsers`): Xid,
the OOM killer, ECC, link changes. Plain lines are not evidence and are dropped here.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from lanes_contract.events import EvidenceData
from lanes_evidence.parsers import parse_kernel

_MAX_RECORD = 8192
"""A read of /dev/kmsg must offer room for a whole record (the kernel's limit is below this)."""


@dataclass(frozen=True)
class KmsgRecord:
    """One kernel log record."""

    sequence: int
    since_boot: timedelta
    priority: int
    text: str


def parse_record(raw: str) -> KmsgRecord | None:
    """A /dev/kmsg record, or None for what is not one (a malformed read is never fatal)."""
    header, sep, rest = raw.partition(";")
    if not sep:
        return None
    fields = header.split(",")
    if len(fields) < 3:  # noqa: PLR2004 - priority, sequence, timestamp (flags and more may follow)
        return None
    try:
        priority, sequence, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    text = rest.split("\n", 1)[0]  # continuation lines (" KEY=value") carry device metadata only
    return KmsgRecord(sequence, timedelta(microseconds=usec), priority & 7, text)


def boot_time() -> datetime:
    """The wall time of this boot, on the clock kmsg timestamps count (monotonic)."""
    return datetime.now(UTC) - timedelta(seconds=time.clock_gettime(time.CLOCK_MONOTONIC))


def boot_id() -> str:
    """This boot's id: a stored position belongs to one boot only."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def kernel_evidence(record: KmsgRecord) -> EvidenceData | None:
    """The evidence a kernel record carries (Xid, OOM kill, ECC, link), or None for a plain line."""
    found = parse_kernel(record.text)
    if found is None:
        return None
    fields = {k: v for k, v in found.fields.items() if v is not None}
    return EvidenceData(lines=(record.text[:1024],), origin="kmsg", **fields)


@dataclass
class Position:
    """Where a follower stopped: the boot, and the last sequence number it handled."""

    boot: str
    sequence: int

    @classmethod
    def load(cls, path: Path) -> Position | None:
        """The stored position, or None (none stored, or unreadable: start from now)."""
        try:
            stored = json.loads(path.read_text())
            return cls(str(stored["boot"]), int(stored["sequence"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, path: Path) -> None:
        """Store it atomically (a crash leaves the old position or the new, never half of one)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"boot": self.boot, "sequence": self.sequence}))
        partial.replace(path)


class KmsgReader:
    """Non-blocking reads of /dev/kmsg from a resume position (or from now, with none for this boot)."""

    def __init__(self, path: Path, resume: Position | None, boot: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.lost = 0
        """Records the ring buffer overwrote before they were read."""
        self._after = resume.sequence if resume is not None and resume.boot == boot else None
        if self._after is None:
            os.lseek(self._fd, 0, os.SEEK_END)  # a first start reads what happens from now on

    def close(self) -> None:
        """Release the file."""
        os.close(self._fd)

    def available(self) -> Iterator[KmsgRecord]:
        """Every record readable now, past the resume position."""
        while True:
            try:
                raw = os.read(self._fd, _MAX_RECORD)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while we were away: the next read continues
                    self.lost += 1
                    continue
                raise
            record = parse_record(raw.decode(errors="replace"))
            if record is None or (self._after is not None and record.sequence <= self._after):
                continue
            yield record
