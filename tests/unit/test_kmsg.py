"""Reading /dev/kmsg records: the record format, wall time, and the stored resume position."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from lanes_agent.kmsg import KmsgRecord, Position, kernel_evidence, parse_record
from lanes_contract.events import EvidenceCategory


def test_a_record_gives_its_sequence_time_since_boot_priority_and_text_without_continuation_lines() -> None:
    raw = "3,1402,11571454701,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4101, GPU has fallen off the bus.\n"
    raw += " SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n"
    record = parse_record(raw)
    assert record == KmsgRecord(
        sequence=1402,
        since_boot=timedelta(microseconds=11571454701),
        priority=3,
        text="NVRM: Xid (PCI:0000:3b:00): 79, pid=4101, GPU has fallen off the bus.",
    )


def test_a_user_space_record_keeps_the_severity_of_its_facility_and_priority() -> None:
    record = parse_record("11,346,11598734606,-;lanes probe")  # LOG_USER (1) << 3 | LOG_ERR (3)
    assert record is not None
    assert record.priority == 3


def test_what_is_not_a_record_is_none() -> None:
    assert parse_record("no header here") is None
    assert parse_record("x,y,z,-;text") is None
    assert parse_record("6,1;too short") is None


def test_kernel_lines_that_are_evidence_become_it_and_plain_lines_do_not() -> None:
    oom = KmsgRecord(
        9, timedelta(seconds=1), 3, "Memory cgroup out of memory: Killed process 4357 (python) total-vm:1kB"
    )
    data = kernel_evidence(oom)
    assert data is not None
    assert (data.category, data.pid, data.origin) == (EvidenceCategory.OOM_KILL, 4357, "kmsg")
    assert kernel_evidence(KmsgRecord(10, timedelta(seconds=1), 6, "EXT4-fs (vda): mounted filesystem")) is None


def test_the_position_survives_a_restart_and_a_damaged_one_means_start_from_now(tmp_path: Path) -> None:
    path = tmp_path / "agent" / "kmsg.position"
    assert Position.load(path) is None
    Position("boot-1", 1402).save(path)
    assert Position.load(path) == Position("boot-1", 1402)
    path.write_text("{not json")
    assert Position.load(path) is None
