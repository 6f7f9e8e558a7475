"""The audit hash chain, as pure functions.

Each stored message becomes one canonical byte string (stream, sequence, subject, headers sorted by
name, then the payload as stored), and each link's hash is SHA-256 over the previous link's hash and the
canonical bytes. Changing a byte, dropping, reordering or inserting a link breaks the chain at that
position; comparing the chain with the stream names the first sequence where they disagree.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

GENESIS = bytes(32)
"""The hash before the first link."""
_FORMAT = b"lanes-audit-v1\n"


def canonical_bytes(stream: str, seq: int, subject: str, headers: Mapping[str, str] | None, payload: bytes) -> bytes:
    """The bytes a link commits to: everything JetStream stored for the message, in one fixed order."""
    meta = {"stream": stream, "seq": seq, "subject": subject, "headers": dict(sorted((headers or {}).items()))}
    return (
        _FORMAT + json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n" + payload
    )


def link_hash(previous: bytes, canonical: bytes) -> bytes:
    """The hash of a link: SHA-256 over the previous hash and this link's canonical bytes."""
    return hashlib.sha256(previous + canonical).digest()


@dataclass(frozen=True)
class Link:
    """One row of the audit table: its position in the chain, the stream sequence, bytes and hashes."""

    position: int
    seq: int
    canonical: bytes
    previous: bytes
    hash: bytes


@dataclass(frozen=True)
class StoredMessage:
    """One message as the stream holds it now."""

    seq: int
    canonical: bytes


class ProblemKind(StrEnum):
    """How the audit copy disagrees with itself or with the stream."""

    ALTERED = "altered"
    MISSING = "missing"
    REORDERED = "reordered"
    INJECTED = "injected"
    BROKEN_LINK = "broken_link"
    FORGED = "forged"
    """Not signed by an identity allowed to write the event (see `signers`)."""
    STALLED = "stalled"
    """The recorder can no longer reach the end of the stream (it acknowledged events the chain lacks)."""


@dataclass(frozen=True)
class Problem:
    """One place where the audit copy cannot be trusted, and why."""

    kind: ProblemKind
    seq: int | None
    position: int | None
    detail: str


@dataclass(frozen=True)
class ProblemSummary:
    """Every problem of one kind: how many, the first, and the sequences (or positions) they name."""

    kind: ProblemKind
    count: int
    """How many places (sequences, or positions where no sequence is known) have this problem."""
    first: Problem
    seqs: tuple[int, ...]
    positions: tuple[int, ...]
    """Positions of the problems that name no sequence (a checkpoint, a hole in the chain)."""


def _place(problem: Problem) -> tuple[str, int | str]:
    """Where a problem is: its sequence, else its position, else what it says (two checks may find one place)."""
    if problem.seq is not None:
        return ("seq", problem.seq)
    if problem.position is not None:
        return ("position", problem.position)
    return ("detail", problem.detail)


def summarize(problems: Iterable[Problem]) -> list[ProblemSummary]:
    """Group problems by kind, in the order each kind was first found, each with every place it names.

    The count is of places, not findings: an altered link is found by the chain and by the stream, once.
    """
    grouped: dict[ProblemKind, list[Problem]] = {}
    for problem in problems:
        grouped.setdefault(problem.kind, []).append(problem)
    return [
        ProblemSummary(
            kind=kind,
            count=len({_place(p) for p in found}),
            first=found[0],
            seqs=tuple(sorted({p.seq for p in found if p.seq is not None})),
            positions=tuple(sorted({p.position for p in found if p.seq is None and p.position is not None})),
        )
        for kind, found in grouped.items()
    ]


def as_ranges(numbers: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted numbers as inclusive (first, last) runs: [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    runs: list[tuple[int, int]] = []
    for number in sorted(set(numbers)):
        if runs and number == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], number)
        else:
            runs.append((number, number))
    return runs


def verify_chain(links: Iterable[Link]) -> list[Problem]:
    """Check the table alone: each link points at its predecessor and hashes to what it says.

    Every problem is reported, not only the first: after one, the check goes on from the link it found
    (trusting that link's own hash), so a later tampering is still named and one bad link is named once.
    """
    problems: list[Problem] = []
    previous, expected_position, last_seq = GENESIS, 1, 0
    for link in links:
        after_a_hole = link.position != expected_position
        if after_a_hole:
            # One problem per missing position, so the count says how many links are gone; the chain never
            # skips a stream sequence, so each missing position's sequence is counted back from this link.
            problems.extend(
                Problem(
                    ProblemKind.MISSING,
                    link.seq - (link.position - position),
                    position,
                    f"no link at position {position}",
                )
                for position in range(expected_position, link.position)
            )
        if link.seq <= last_seq:
            detail = f"sequence {link.seq} comes after {last_seq}"
            problems.append(Problem(ProblemKind.REORDERED, link.seq, link.position, detail))
        elif link.previous != previous and not after_a_hole:  # after a hole, its predecessor is the one gone
            problems.append(
                Problem(ProblemKind.BROKEN_LINK, link.seq, link.position, "does not point at the previous link")
            )
        if link_hash(link.previous, link.canonical) != link.hash:
            problems.append(Problem(ProblemKind.ALTERED, link.seq, link.position, "content does not match its hash"))
        previous, expected_position, last_seq = link.hash, link.position + 1, max(last_seq, link.seq)
    return problems


def compare_with_stream(links: Iterable[Link], stream: Iterable[StoredMessage]) -> list[Problem]:
    """Check the table against the stream, in sequence order: every missing, altered or injected event.

    `stream` holds the messages the copy must have (those at or below what the recorder is known to have
    recorded); a stream message without a link is missing, a link without a stream message injected.
    """
    by_seq = {link.seq: link for link in links}
    problems: list[Problem] = []
    seen: set[int] = set()
    for message in stream:
        link = by_seq.get(message.seq)
        if link is None:
            problems.append(Problem(ProblemKind.MISSING, message.seq, None, "in the stream, not in the audit copy"))
            continue
        if link.canonical != message.canonical:
            problems.append(Problem(ProblemKind.ALTERED, message.seq, link.position, "differs from the stream"))
        seen.add(message.seq)
    for seq in sorted(set(by_seq) - seen):
        link = by_seq[seq]
        problems.append(Problem(ProblemKind.INJECTED, seq, link.position, "in the audit copy, not in the stream"))
    return problems


RECORDER_DURABLE = "audit"
"""The audit recorder's durable consumer on the jobs stream."""


@dataclass(frozen=True)
class RecorderState:
    """The recorder's durable consumer as the stream server sees it."""

    durable: str
    acknowledged: int | None
    """The stream sequence through which it acknowledged every message (its ack floor); None: no such consumer.
    The recorder acknowledges a message only after its link committed, so the chain must reach this far."""


def must_reach(links: Sequence[Link], acknowledged: int, checkpointed: int) -> int:
    """The stream sequence through which the copy must be complete; a gap at or below it is loss, not lag.

    The chain's own head, what the recorder acknowledged, and the last signed checkpoint: a checkpoint at
    position P proves the chain once held P links, and since the chain never skips a sequence, its link P
    was the stream sequence P positions on from any surviving link.
    """
    floor = max(max((link.seq for link in links), default=0), acknowledged)
    if links and checkpointed:
        anchor = links[0]
        floor = max(floor, anchor.seq + checkpointed - anchor.position)
    return floor


def recorder_problems(links: Sequence[Link], recorder: RecorderState, not_yet_recorded: int) -> list[Problem]:
    """A recorder that can never reach the end of the stream, named.

    One that acknowledged past the chain's head will never be sent those messages again: it waits for a gap
    to fill that never does. One whose consumer is gone records nothing more.
    """
    head = max((link.seq for link in links), default=0)
    if recorder.acknowledged is None:
        if links and not_yet_recorded:
            detail = f"no consumer {recorder.durable}: {not_yet_recorded} newer events are not being recorded"
            return [Problem(ProblemKind.STALLED, None, None, detail)]
        return []
    if recorder.acknowledged > head:
        detail = (
            f"recorder {recorder.durable} acknowledged through sequence {recorder.acknowledged} but the chain "
            f"ends at {head}: it waits for {head + 1} forever"
        )
        return [Problem(ProblemKind.STALLED, head + 1, None, detail)]
    return []
