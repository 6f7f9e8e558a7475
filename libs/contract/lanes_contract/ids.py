"""Identifiers: time-sortable event ids, deterministic derived ids, dedupe ids and subject-safe tokens."""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from datetime import datetime

# A token becomes one NATS subject token, so it must never contain `.`, `*`, `>` or whitespace.
# The character set is deliberately narrow: ids are also used as PostgreSQL keys and file names.
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,127}")
TOKEN_PATTERN = f"^{_TOKEN.pattern}$"
"""A subject token (job, node, model, replica id) as a JSON Schema pattern."""


def is_valid_token(value: str) -> bool:
    """Whether `value` may be used as a subject token (job id, node id, model, replica)."""
    return _TOKEN.fullmatch(value) is not None


def validate_token(value: str) -> str:
    """Return `value` unchanged, or raise ValueError saying why it cannot be a subject token."""
    if not is_valid_token(value):
        msg = (
            f"{value!r} is not a valid id: use 1-128 characters from A-Z a-z 0-9 _ -, "
            "starting with a letter or digit (no '.', '*', '>' or spaces)"
        )
        raise ValueError(msg)
    return value


def _uuid7_from(unix_ms: int, tail: bytes) -> str:
    """Build an RFC 9562 version-7 UUID from a millisecond timestamp and 10 bytes of tail."""
    value = (unix_ms & ((1 << 48) - 1)) << 80
    value |= int.from_bytes(tail[:10], "big") & ((1 << 80) - 1)
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return str(uuid.UUID(int=value))


def new_event_id() -> str:
    """A new time-sortable event id (UUIDv7), so ids sort in the order they were made."""
    return _uuid7_from(time.time_ns() // 1_000_000, os.urandom(10))


def derived_event_id(causation_id: str, event_type: str, key: str = "", *, at: datetime | None = None) -> str:
    """A deterministic id for an event derived from another one.

    A handler that runs twice for the same cause (after a crash) produces the same ids, so JetStream's
    duplicate window drops the second publish. The timestamp part is `at` (the cause's time) when given,
    else taken from the cause id when it is a UUIDv7, which keeps derived ids sortable next to their cause.
    """
    digest = hashlib.sha256(f"{causation_id}\x1f{event_type}\x1f{key}".encode()).digest()
    if at is not None:
        return _uuid7_from(int(at.timestamp() * 1000), digest)
    try:
        cause = uuid.UUID(causation_id)
        unix_ms = cause.int >> 80 if cause.version == 7 else 0  # noqa: PLR2004 - UUID version number
    except ValueError:
        unix_ms = 0
    return _uuid7_from(unix_ms, digest)


def dedupe_id(subject: str, event_id: str) -> str:
    """The `Nats-Msg-Id` of an event: its id scoped to its subject (`ce-id` stays the bare id).

    JetStream de-duplicates on this header across every subject of a stream, and many ids are derived from
    what anyone can know (a submission's from its job id). Scoped, an event published through the codec
    on one subject never takes the id of an event on another; a header written by hand can still claim
    any id, which the publish detects (`lanes_contract.client`, EventIdConflictError).
    """
    return f"{subject}/{event_id}"
