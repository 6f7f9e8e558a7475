"""The node agent's kernel log reader on this machine's real /dev/kmsg (root): from now, and resumed."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from lanes_agent.kmsg import KmsgReader, Position, boot_id, boot_time

KMSG = Path("/dev/kmsg")
pytestmark = pytest.mark.skipif(not os.access(KMSG, os.R_OK | os.W_OK), reason="needs a readable, writable /dev/kmsg")


def _write(line: str) -> None:
    # A record is complete at its newline: without one the kernel holds it open for a continuation.
    with KMSG.open("w") as kmsg:
        kmsg.write(f"<6>{line}\n")


def _mine(reader: KmsgReader, tag: str) -> list[str]:
    return [r.text for r in reader.available() if tag in r.text]


def test_a_first_start_reads_from_now_and_a_restart_resumes_after_the_last_record_handled() -> None:
    tag = uuid.uuid4().hex[:8]
    _write(f"lanes test {tag} before the agent started")
    boot = boot_id()
    first = KmsgReader(KMSG, None, boot)
    _write(f"lanes test {tag} one")
    _write(f"lanes test {tag} two")
    records = [r for r in first.available() if tag in r.text]
    first.close()
    assert [r.text for r in records] == [f"lanes test {tag} one", f"lanes test {tag} two"]
    assert records[0].sequence + 1 == records[1].sequence
    # Timestamps are since boot; in wall time they fall within this test.
    assert abs((boot_time() + records[1].since_boot) - (boot_time() + records[0].since_boot)).total_seconds() < 60

    # The agent handled "one" and was killed; restarted, it reads "two" (still in the ring buffer) and what came
    # after, and never "one" again.
    _write(f"lanes test {tag} three")
    resumed = KmsgReader(KMSG, Position(boot, records[0].sequence), boot)
    assert _mine(resumed, tag) == [f"lanes test {tag} two", f"lanes test {tag} three"]
    resumed.close()

    # A position from another boot is meaningless here: start from now.
    other = KmsgReader(KMSG, Position("another-boot", records[0].sequence), boot)
    _write(f"lanes test {tag} four")
    assert _mine(other, tag) == [f"lanes test {tag} four"]
    other.close()
