"""The audit hash chain, as pure functions.

Each stored message becomes one canonical byte string (stream, sequence, subject, headers sorted by
name, then the payload as stored), and each link's hash is SHA-256 over the previous link's hash and the
canonical bytes. Changing a byte, dropping, reordering or inserting a link breaks the chain at that
position; comparing the chain with the stream names the first sequence where they disagree.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
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


@dataclass(frozen=True)
class Problem:
    """The first place where the audit copy cannot be trusted, and why."""

    kind: ProblemKind
    seq: int | None
    position: int | None
    detail: str


def verify_chain(links: Iterable[Link]) -> Problem | None:
    """Check the table alone: each link points at its predecessor and hashes to what it says."""
    previous, expected_position, last_seq = GENESIS, 1, 0
    for link in links:
        if link.position != expected_position:
            return Problem(ProblemKind.MISSING, link.seq, expected_position, f"no link at position {expected_position}")
        if link.seq <= last_seq:
            return Problem(
                ProblemKind.REORDERED, link.seq, link.position, f"sequence {link.seq} comes after {last_seq}"
            )
        if link.previous != previous:
            return Problem(ProblemKind.BROKEN_LINK, link.seq, link.position, "does not point at the previous link")
        if link_hash(previous, link.canonical) != link.hash:
            return Problem(ProblemKind.ALTERED, link.seq, link.position, "content does not match its hash")
        previous, expected_position, last_seq = link.hash, expected_position + 1, link.seq
    return None


def compare_with_stream(links: Iterable[Link], stream: Iterable[StoredMessage]) -> Problem | None:
    """Check the table against the stream, in sequence order: the first missing, altered or injected event."""
    by_seq = {link.seq: link for link in links}
    seen: set[int] = set()
    for message in stream:
        link = by_seq.get(message.seq)
        if link is None:
            return Problem(ProblemKind.MISSING, message.seq, None, "in the stream, not in the audit copy")
        if link.canonical != message.canonical:
            return Problem(ProblemKind.ALTERED, message.seq, link.position, "differs from the stream")
        seen.add(message.seq)
    injected = sorted(set(by_seq) - seen)
    if injected:
        first = by_seq[injected[0]]
        return Problem(ProblemKind.INJECTED, first.seq, first.position, "in the audit copy, not in the stream")
    return None
