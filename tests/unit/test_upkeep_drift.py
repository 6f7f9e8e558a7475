"""How a live durable is judged against its spec (`lanes_runtime.upkeep.drift_of`): made again, updated, or left."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from nats.js.api import AckPolicy, ConsumerInfo, DeliverPolicy, SequenceInfo

from lanes_contract.streams import JOBS
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.upkeep import Drift, Floor, drift_of

SPEC = ConsumerSpec(durable="scheduler-jobs", stream=JOBS, subjects=("lanes.job.*.submitted",), ack_wait_s=30.0)
RECORDED = Floor(ack_floor=100, stream_created=None)


def info(acked: int = 120, changes: dict[str, object] | None = None) -> ConsumerInfo:
    """The durable as the server reports it: the spec's config, as the server fills it in, with `changes`."""
    filled_in: dict[str, object] = {"max_waiting": 512, "headers_only": False}
    config = dataclasses.replace(SPEC.config(), **(filled_in | (changes or {})))  # type: ignore[arg-type]
    return ConsumerInfo(
        name=SPEC.durable,
        stream_name=JOBS.name,
        config=config,
        created=dt.datetime.now(dt.UTC),
        ack_floor=SequenceInfo(consumer_seq=acked, stream_seq=acked),
    )


def test_a_durable_as_provisioned_has_not_drifted() -> None:
    assert not drift_of(SPEC, info(), RECORDED)
    assert not drift_of(SPEC, info(), None)


def test_one_made_again_after_the_recorded_floor_has_not_drifted() -> None:
    restored = info(100, {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": RECORDED.ack_floor + 1})
    assert not drift_of(SPEC, restored, RECORDED)


@pytest.mark.parametrize(
    ("changes", "acked", "field"),
    [
        ({"filter_subjects": ["lanes.job.nobody.nothing"]}, 120, "filter_subjects"),
        ({"filter_subjects": None, "filter_subject": "lanes.job.*.submitted"}, 120, None),
        ({"ack_policy": AckPolicy.NONE}, 120, "ack_policy"),
        ({"deliver_policy": DeliverPolicy.NEW}, 120, "deliver_policy"),
        ({}, 3, "deliver_policy (started over from the start of the stream)"),
        (
            {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": 500},
            499,
            "opt_start_seq (starts past the recorded ack floor)",
        ),
        ({"headers_only": True}, 120, "headers_only"),
        ({"deliver_subject": "elsewhere"}, 120, "deliver_subject"),
    ],
)
def test_a_durable_that_delivers_otherwise_is_made_again(
    changes: dict[str, object], acked: int, field: str | None
) -> None:
    expected = Drift(remake=(field,)) if field is not None else Drift()
    assert drift_of(SPEC, info(acked, changes), RECORDED) == expected


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"ack_wait": 600.0}, "ack_wait"),
        ({"max_deliver": 1}, "max_deliver"),
        ({"max_ack_pending": 1}, "max_ack_pending"),
    ],
)
def test_a_durable_that_only_retries_otherwise_is_updated_in_place(changes: dict[str, object], field: str) -> None:
    assert drift_of(SPEC, info(changes=changes), RECORDED) == Drift(update=(field,))


def test_a_paused_durable_is_made_again() -> None:
    paused = dataclasses.replace(info(), paused=True)
    assert drift_of(SPEC, paused, RECORDED) == Drift(remake=("paused",))
