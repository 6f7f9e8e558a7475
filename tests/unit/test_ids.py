"""Unit tests for ``lanes_contract.ids``: UUIDv7 event ids, deterministic derived ids, subject-safe tokens."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lanes_contract import ids
from lanes_contract.events import (
    JobPlaced,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    derive,
)
from lanes_contract.ids import derived_event_id, is_valid_token, new_event_id, validate_token
from lanes_contract.jobs import JobSpec, JobState


def _unix_ms(event_id: str) -> int:
    return uuid.UUID(event_id).int >> 80


def _assert_uuid7(event_id: str) -> uuid.UUID:
    parsed = uuid.UUID(event_id)
    assert parsed.version == 7
    assert parsed.variant == uuid.RFC_4122
    assert str(parsed) == event_id  # canonical, lower-case, hyphenated
    return parsed


# --- new_event_id --------------------------------------------------------------------------------


def test_new_event_id_is_a_uuid7_stamped_with_the_current_time():
    before = time.time_ns() // 1_000_000
    event_id = new_event_id()
    after = time.time_ns() // 1_000_000
    _assert_uuid7(event_id)
    assert len(event_id) == 36
    assert before <= _unix_ms(event_id) <= after


def test_new_event_ids_are_unique():
    made = [new_event_id() for _ in range(2000)]
    assert len(set(made)) == len(made)


def test_new_event_ids_differ_in_their_random_tail_within_one_millisecond(monkeypatch):
    monkeypatch.setattr(ids, "time", SimpleNamespace(time_ns=lambda: 1_767_225_600_000_000_000))
    made = {new_event_id() for _ in range(200)}
    assert len(made) == 200
    assert {_unix_ms(event_id) for event_id in made} == {1_767_225_600_000}


def test_new_event_ids_sort_by_creation_time_across_milliseconds(monkeypatch):
    clock = iter(range(1_767_225_600_000, 1_767_225_600_000 + 500 * 7, 7))
    monkeypatch.setattr(ids, "time", SimpleNamespace(time_ns=lambda: next(clock) * 1_000_000))
    made = [new_event_id() for _ in range(500)]
    # Both as strings (what the log and the database compare) and as UUIDs.
    assert sorted(made) == made
    assert sorted(made, key=uuid.UUID) == made


def test_new_event_ids_sort_by_the_real_clock():
    first = new_event_id()
    time.sleep(0.003)
    second = new_event_id()
    assert first < second


@settings(max_examples=200)
@given(
    earlier=st.integers(min_value=0, max_value=(1 << 48) - 2),
    gap=st.integers(min_value=1, max_value=1 << 20),
    tail_a=st.binary(min_size=10, max_size=10),
    tail_b=st.binary(min_size=10, max_size=10),
)
def test_uuid7_order_follows_the_millisecond_whatever_the_random_tail(earlier, gap, tail_a, tail_b):
    later = min(earlier + gap, (1 << 48) - 1)
    a = ids._uuid7_from(earlier, tail_a)
    b = ids._uuid7_from(later, tail_b)
    _assert_uuid7(a)
    _assert_uuid7(b)
    assert _unix_ms(a) == earlier
    assert _unix_ms(b) == later
    assert a < b


# --- derived_event_id ----------------------------------------------------------------------------

CAUSE = "01937a1e-2c4f-7abc-8def-0123456789ab"


def test_derived_id_is_deterministic():
    assert derived_event_id(CAUSE, "io.lanes.job.state_changed.v1", "rank-0") == derived_event_id(
        CAUSE, "io.lanes.job.state_changed.v1", "rank-0"
    )


def test_derived_id_differs_by_cause_type_and_key():
    base = derived_event_id(CAUSE, "io.lanes.job.state_changed.v1")
    variants = {
        base,
        derived_event_id(CAUSE, "io.lanes.job.state_changed.v1", "rank-1"),
        derived_event_id(CAUSE, "io.lanes.job.waiting.v1"),
        derived_event_id("01937a1e-2c4f-7abc-8def-0123456789ac", "io.lanes.job.state_changed.v1"),
    }
    assert len(variants) == 4
    assert CAUSE not in variants


def test_derived_id_is_a_uuid7_with_the_timestamp_of_a_uuid7_cause():
    derived = derived_event_id(CAUSE, "io.lanes.job.state_changed.v1")
    _assert_uuid7(derived)
    assert _unix_ms(derived) == _unix_ms(CAUSE)


def test_derived_id_of_a_fresh_event_sorts_with_its_cause_across_milliseconds(monkeypatch):
    clock = iter([1_000, 1_001])
    monkeypatch.setattr(ids, "time", SimpleNamespace(time_ns=lambda: next(clock) * 1_000_000))
    cause, later_cause = new_event_id(), new_event_id()
    assert derived_event_id(cause, "t") < later_cause


@pytest.mark.parametrize("cause", ["not-a-uuid", "", "job-1/submit", str(uuid.UUID(int=12345, version=4))])
def test_derived_id_of_a_non_uuid7_cause_is_still_a_valid_uuid7(cause):
    derived = derived_event_id(cause, "io.lanes.job.state_changed.v1")
    _assert_uuid7(derived)
    assert _unix_ms(derived) == 0
    assert derived == derived_event_id(cause, "io.lanes.job.state_changed.v1")


# Excluded: the \x1f separator between the parts (so "a\x1fb"+"c" and "a"+"b\x1fc" collide) and lone
# surrogates (which cannot be UTF-8 encoded). Neither can reach here through a validated event id or type.
_parts = st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x1f"), max_size=40)


@settings(max_examples=200)
@given(cause=_parts, event_type=_parts, key=_parts)
def test_derived_id_property(cause, event_type, key):
    derived = derived_event_id(cause, event_type, key)
    _assert_uuid7(derived)
    assert derived == derived_event_id(cause, event_type, key)
    assert derived != derived_event_id(cause, event_type, key + "x")
    assert derived != derived_event_id(cause, event_type + "x", key)
    assert derived != derived_event_id(cause + "x", event_type, key)


def _submitted() -> JobSubmitted:
    return JobSubmitted(
        id=CAUSE,
        source="lanes/api",
        jobid="job-1",
        attempt=1,
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        data=JobSubmittedData(spec=JobSpec(name="train", workers=1)),
    )


def test_derive_builds_the_same_follow_up_twice():
    cause = _submitted()
    data = JobStateChangedData(from_state=JobState.SUBMITTED, to_state=JobState.QUEUED, cause_type=cause.type)
    first = derive(JobStateChanged, cause, source="lanes/lifecycle", data=data)
    again = derive(JobStateChanged, cause, source="lanes/lifecycle", data=data)
    assert first.id == again.id == derived_event_id(CAUSE, "io.lanes.job.state_changed.v1", at=cause.time)
    assert first.causationid == CAUSE
    assert first.correlationid == CAUSE  # the cause started the story
    assert (first.jobid, first.attempt, first.traceparent) == (cause.jobid, cause.attempt, cause.traceparent)
    other_key = derive(JobStateChanged, cause, key="rank-1", source="lanes/lifecycle", data=data)
    assert other_key.id != first.id


def test_derive_keeps_the_correlation_id_of_the_cause_and_lets_fields_override():
    cause = _submitted().model_copy(update={"correlationid": "story-7"})
    data = JobStateChangedData(from_state=None, to_state=JobState.QUEUED, cause_type=cause.type)
    follow_up = derive(JobStateChanged, cause, source="lanes/lifecycle", attempt=2, data=data)
    assert follow_up.correlationid == "story-7"
    assert follow_up.attempt == 2


def test_derive_validates_the_follow_up():
    with pytest.raises(ValidationError):
        derive(JobPlaced, _submitted(), source="lanes/scheduler", data={"assignments": []})


# --- tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    ["job-1", "A", "7", "node_17", "Train-LLM_v2", "0abc", "x" * 128, "a-", "a_"],
)
def test_valid_tokens_are_returned_unchanged(token):
    assert validate_token(token) == token
    assert is_valid_token(token)


@pytest.mark.parametrize(
    "token",
    [
        pytest.param(".", id="dot"),
        pytest.param("job.1", id="inner-dot"),
        pytest.param("*", id="star"),
        pytest.param("job*", id="inner-star"),
        pytest.param(">", id="gt"),
        pytest.param("job>", id="inner-gt"),
        pytest.param("job 1", id="space"),
        pytest.param(" job", id="leading-space"),
        pytest.param("job ", id="trailing-space"),
        pytest.param("job\t1", id="tab"),
        pytest.param("job\n", id="trailing-newline"),
        pytest.param("", id="empty"),
        pytest.param("x" * 129, id="too-long"),
        pytest.param("-job", id="leading-dash"),
        pytest.param("_job", id="leading-underscore"),
        pytest.param("jöb", id="non-ascii"),
        pytest.param("job/1", id="slash"),
    ],
)
def test_invalid_tokens_are_rejected(token):
    assert not is_valid_token(token)
    with pytest.raises(ValueError, match="not a valid id"):
        validate_token(token)


@settings(max_examples=200)
@given(
    prefix=st.text(max_size=10),
    bad=st.sampled_from([".", "*", ">", " ", "\t", "\n", "\r", "\x00"]),
    suffix=st.text(max_size=10),
)
def test_a_token_with_a_subject_metacharacter_or_whitespace_is_always_rejected(prefix, bad, suffix):
    assert not is_valid_token(prefix + bad + suffix)


def test_token_validation_applies_to_event_join_keys():
    with pytest.raises(ValidationError, match="not a valid id"):
        JobSpec(name="my job", workers=1)
    with pytest.raises(ValidationError, match="not a valid id"):
        JobSubmitted(source="lanes/api", jobid="job.1", data=JobSubmittedData(spec=JobSpec(name="train", workers=1)))


def test_a_derived_id_carries_the_time_it_is_given():
    at = datetime(2026, 12, 2, 10, 0, 0, 123000, tzinfo=UTC)
    derived = uuid.UUID(derived_event_id("not-a-uuid", "t", at=at))
    assert derived.version == 7
    assert derived.int >> 80 == int(at.timestamp() * 1000)
