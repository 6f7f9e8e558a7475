"""Unit tests for ``lanes_contract.streams.strengthened``: provisioning only ever strengthens a stream."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from lanes_contract.codec import MAX_EVENT_BYTES
from lanes_contract.errors import StreamConflictError
from lanes_contract.streams import (
    ALL_STREAMS,
    DEAD,
    JOBS,
    MAX_EVENT_MESSAGE_BYTES,
    MAX_PAYLOAD_BYTES,
    NODES,
    TELEMETRY,
    strengthened,
)

_DAY = 86_400.0


def _wanted() -> StreamConfig:
    return JOBS.config()


@pytest.mark.parametrize("spec", ALL_STREAMS, ids=lambda spec: spec.name)
def test_identical_config_needs_nothing(spec):
    assert strengthened(spec.config(), spec.config()) is None


def test_the_jobs_stream_is_an_audit_log():
    # What the tests below rely on: JOBS wants a year, deny_delete and deny_purge.
    wanted = _wanted()
    assert wanted.max_age == 365 * _DAY
    assert wanted.deny_delete
    assert wanted.deny_purge
    assert wanted.retention == RetentionPolicy.LIMITS
    assert wanted.storage == StorageType.FILE


def test_a_shorter_max_age_is_raised_and_nothing_else_changes():
    existing = replace(_wanted(), max_age=30 * _DAY)
    merged = strengthened(existing, _wanted())
    assert merged is not None
    assert merged.max_age == 365 * _DAY
    assert replace(merged, max_age=existing.max_age) == existing


@pytest.mark.parametrize("longer", [400 * _DAY, 0.0, None], ids=["400-days", "zero-means-forever", "unset"])
def test_a_longer_max_age_is_never_shortened(longer):
    existing = replace(_wanted(), max_age=longer)
    assert strengthened(existing, _wanted()) is None


def test_a_missing_subject_is_added_after_the_existing_ones():
    existing = replace(_wanted(), subjects=["legacy.jobs.>"])
    merged = strengthened(existing, _wanted())
    assert merged is not None
    assert merged.subjects == ["legacy.jobs.>", "lanes.job.>"]


def test_an_empty_subject_list_gets_the_wanted_subjects():
    merged = strengthened(replace(_wanted(), subjects=None), _wanted())
    assert merged is not None
    assert merged.subjects == ["lanes.job.>"]


def test_extra_existing_subjects_are_kept():
    existing = replace(_wanted(), subjects=["lanes.job.>", "legacy.jobs.>"])
    assert strengthened(existing, _wanted()) is None


@pytest.mark.parametrize(
    ("attr", "value"),
    [
        ("retention", RetentionPolicy.WORK_QUEUE),
        ("retention", RetentionPolicy.INTEREST),
        ("storage", StorageType.MEMORY),
    ],
)
def test_a_retention_or_storage_change_is_a_conflict(attr, value):
    changed: dict[str, Any] = {attr: value}
    existing = replace(_wanted(), **changed)
    with pytest.raises(StreamConflictError, match=f"LANES_JOBS has {attr}="):
        strengthened(existing, _wanted())


def test_a_conflict_is_raised_even_when_other_fields_could_be_strengthened():
    existing = replace(_wanted(), retention=RetentionPolicy.WORK_QUEUE, max_age=_DAY, deny_delete=False)
    with pytest.raises(StreamConflictError):
        strengthened(existing, _wanted())


@pytest.mark.parametrize("attr", ["deny_delete", "deny_purge", "allow_direct"])
def test_audit_protections_are_switched_on(attr):
    off: dict[str, Any] = {attr: False}
    existing = replace(_wanted(), **off)
    merged = strengthened(existing, _wanted())
    assert merged is not None
    assert getattr(merged, attr) is True
    assert replace(merged, **off) == existing


@pytest.mark.parametrize("attr", ["deny_delete", "deny_purge"])
def test_audit_protections_are_never_switched_off(attr):
    # TELEMETRY does not ask for them, but a stream that has them keeps them.
    on: dict[str, Any] = {attr: True}
    existing = replace(TELEMETRY.config(), **on)
    assert strengthened(existing, TELEMETRY.config()) is None


def test_replicas_are_raised():
    wanted = replace(NODES, replicas=3).config()
    merged = strengthened(NODES.config(), wanted)
    assert merged is not None
    assert merged.num_replicas == 3


def test_replicas_are_never_lowered():
    existing = replace(NODES, replicas=5).config()
    assert strengthened(existing, NODES.config()) is None


def test_unset_replicas_count_as_one():
    assert strengthened(replace(NODES.config(), num_replicas=None), NODES.config()) is None


def test_a_shorter_duplicate_window_is_widened():
    merged = strengthened(replace(_wanted(), duplicate_window=30.0), _wanted())
    assert merged is not None
    assert merged.duplicate_window == _wanted().duplicate_window


def test_a_limit_is_raised_to_unlimited_but_an_unlimited_limit_stays():
    limited = replace(_wanted(), max_msgs_per_subject=100, max_bytes=1 << 30)
    merged = strengthened(limited, _wanted())
    assert merged is not None
    assert merged.max_msgs_per_subject == -1
    assert merged.max_bytes == -1
    assert strengthened(_wanted(), replace(_wanted(), max_msgs_per_subject=100)) is None


@pytest.mark.parametrize("spec", ALL_STREAMS, ids=lambda spec: spec.name)
def test_every_stream_takes_the_largest_event_and_nothing_the_server_would_not(spec):
    """Sized from the codec's limit: an event of MAX_EVENT_BYTES with its headers fits, and no stream takes more
    than the server's max_payload (a dead letter is the largest message: any stream's, plus why it died)."""
    size = spec.config().max_msg_size
    assert MAX_EVENT_BYTES < MAX_EVENT_MESSAGE_BYTES <= size <= MAX_PAYLOAD_BYTES
    assert (size == MAX_PAYLOAD_BYTES) is (spec is DEAD)


@pytest.mark.parametrize("existing_size", [None, -1, 0, 1 << 20])
def test_an_unlimited_or_larger_message_size_is_lowered_to_the_largest_event(existing_size):
    """A stream made before the limit (max_msg_size -1: one raw 1 MB message was stored in LANES_JOBS) is fixed
    by provisioning, which otherwise only raises limits."""
    merged = strengthened(replace(_wanted(), max_msg_size=existing_size), _wanted())
    assert merged is not None
    assert merged.max_msg_size == MAX_EVENT_MESSAGE_BYTES


def test_fields_lanes_does_not_manage_are_left_alone():
    # A smaller message size than Lanes needs is the operator's business too: never raised.
    existing = replace(_wanted(), description="edited by an operator", max_age=_DAY, max_msg_size=1024)
    merged = strengthened(existing, _wanted())
    assert merged is not None
    assert merged.description == "edited by an operator"
    assert merged.max_msg_size == 1024
    assert merged.name == "LANES_JOBS"


def test_strengthened_does_not_mutate_its_inputs():
    existing = replace(_wanted(), max_age=_DAY, subjects=["legacy.jobs.>"], deny_delete=False, num_replicas=1)
    wanted = replace(_wanted(), num_replicas=3)
    existing_before, wanted_before = copy.deepcopy(existing), copy.deepcopy(wanted)
    merged = strengthened(existing, wanted)
    assert merged is not None
    assert merged is not existing
    assert existing == existing_before
    assert wanted == wanted_before
    assert existing.subjects == ["legacy.jobs.>"]


_ages = st.sampled_from([None, 0.0]) | st.floats(min_value=1.0, max_value=800 * _DAY)
_limits = st.sampled_from([None, -1]) | st.integers(min_value=0, max_value=10**9)
_subjects = st.lists(st.sampled_from(["lanes.job.>", "legacy.jobs.>", "other.>"]), unique=True, max_size=3)


def _age_rank(age: float | None) -> float:
    return age or float("inf")


def _limit_rank(limit: int | None) -> float:
    return float("inf") if limit is None or limit < 0 else float(limit)


def _size_rank(limit: int | None) -> float:
    return float("inf") if not limit or limit < 0 else float(limit)


_existing_fields = st.fixed_dictionaries(
    {
        "max_age": _ages,
        "max_msgs_per_subject": _limits,
        "max_bytes": _limits,
        "duplicate_window": st.none() | st.floats(min_value=0.0, max_value=3600.0),
        "num_replicas": st.none() | st.integers(min_value=1, max_value=5),
        "deny_delete": st.booleans(),
        "deny_purge": st.booleans(),
        "subjects": st.none() | _subjects,
        "max_msg_size": _limits,
    }
)


@settings(max_examples=300)
@given(fields=_existing_fields, wanted_replicas=st.integers(min_value=1, max_value=5))
def test_strengthening_is_monotonic_and_idempotent(fields, wanted_replicas):
    wanted = replace(JOBS, replicas=wanted_replicas).config()
    existing = replace(wanted, **fields)
    merged = strengthened(existing, wanted)
    result = existing if merged is None else merged
    # Never weaker than what existed ...
    assert _age_rank(result.max_age) >= _age_rank(existing.max_age)
    assert _limit_rank(result.max_msgs_per_subject) >= _limit_rank(existing.max_msgs_per_subject)
    assert _limit_rank(result.max_bytes) >= _limit_rank(existing.max_bytes)
    assert (result.duplicate_window or 0) >= (existing.duplicate_window or 0)
    assert (result.num_replicas or 1) >= (existing.num_replicas or 1)
    assert result.deny_delete >= existing.deny_delete
    assert result.deny_purge >= existing.deny_purge
    assert set(existing.subjects or []) <= set(result.subjects or [])
    # (a message size is strengthened by lowering it)
    assert _size_rank(result.max_msg_size) <= _size_rank(existing.max_msg_size)
    # ... at least what is wanted ...
    assert _age_rank(result.max_age) >= _age_rank(wanted.max_age)
    assert (result.num_replicas or 1) >= wanted_replicas
    assert result.deny_delete
    assert result.deny_purge
    assert "lanes.job.>" in (result.subjects or [])
    assert _size_rank(result.max_msg_size) <= _size_rank(wanted.max_msg_size)
    # ... and a second pass has nothing left to do.
    assert strengthened(result, wanted) is None
    # A merged config is only returned when something actually changed.
    assert merged is None or merged != existing
