"""A consumer with a pinned client (`ConsumerSpec.pinned_s`): the create request carries its priority group, and a
durable without the pinned-client policy is made again (`lanes_runtime.upkeep.drift_of`)."""

from __future__ import annotations

import dataclasses
import datetime as dt

from nats.js.api import ConsumerInfo, SequenceInfo

from lanes_contract.streams import TELEMETRY
from lanes_runtime.consumer import PRIORITY_GROUP, ConsumerSpec
from lanes_runtime.upkeep import PINNED_CLIENT, drift_of

PINNED = ConsumerSpec(durable="telemetry", stream=TELEMETRY, subjects=("lanes.tel.>",), pinned_s=5.0)
SHARED = dataclasses.replace(PINNED, pinned_s=None)


def _info(spec: ConsumerSpec) -> ConsumerInfo:
    return ConsumerInfo(
        name=spec.durable,
        stream_name=TELEMETRY.name,
        config=spec.config(),
        created=dt.datetime.now(dt.UTC),
        ack_floor=SequenceInfo(consumer_seq=0, stream_seq=0),
    )


def test_the_create_request_of_a_pinned_consumer_names_its_group_policy_and_timeout() -> None:
    body = PINNED.create_request(PINNED.config())
    assert body["stream_name"] == TELEMETRY.name
    config = body["config"]
    assert isinstance(config, dict)
    assert config["name"] == config["durable_name"] == "telemetry"
    assert config["priority_groups"] == [PRIORITY_GROUP]
    assert config["priority_policy"] == PINNED_CLIENT
    assert config["priority_timeout"] == 5_000_000_000  # nanoseconds, as the JetStream API takes durations
    assert PINNED.group == PRIORITY_GROUP


def test_a_shared_consumer_has_no_group() -> None:
    config = SHARED.create_request(SHARED.config())["config"]
    assert isinstance(config, dict)
    assert "priority_groups" not in config
    assert SHARED.group is None


def test_a_pinned_spec_remakes_a_durable_without_the_pinned_client_policy() -> None:
    assert not drift_of(PINNED, _info(PINNED), None, policy=PINNED_CLIENT)
    assert drift_of(PINNED, _info(PINNED), None, policy=None).remake == ("priority_policy",)
    assert not drift_of(SHARED, _info(SHARED), None)  # the policy is not read for a shared durable
