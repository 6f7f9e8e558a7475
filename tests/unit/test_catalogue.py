"""The catalogue's one naming rule, and that every event type is reachable through `AnyEvent`."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lanes_contract.events import EVENT_TYPES, Family, JobSubmitted, JobSubmittedData
from lanes_contract.jobs import JobSpec


def test_every_type_is_derived_from_its_family_and_name() -> None:
    for event_type, cls in EVENT_TYPES.items():
        assert event_type == f"io.lanes.{cls.family}.{cls.name}.v1"
    assert len({(cls.family, cls.name) for cls in EVENT_TYPES.values()}) == len(EVENT_TYPES)


def test_each_family_maps_to_types_and_no_type_is_empty() -> None:
    assert {cls.family for cls in EVENT_TYPES.values()} == set(Family)
    assert all(EVENT_TYPES)


def test_an_event_refuses_another_types_name() -> None:
    spec = JobSpec(name="train", workers=1)
    with pytest.raises(ValidationError):
        JobSubmitted(type="io.lanes.job.placed.v1", source="tests", jobid="j1", data=JobSubmittedData(spec=spec))
