"""The consumer runtime's acknowledgement policy, as a table: outcome x deliveries -> ack | nak | term | hold."""

from __future__ import annotations

import asyncpg
import pytest
from nats.errors import ConnectionClosedError
from nats.js.errors import APIError, ServiceUnavailableError
from redis.exceptions import ConnectionError as RedisConnectionError

from lanes_contract.errors import PoisonEventError, ServerUnavailableError, TransientError
from lanes_contract.streams import JOBS
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.decision import (
    OUTAGE_BACKOFF_S,
    Ack,
    Decision,
    Duplicate,
    Failed,
    Hold,
    Invalid,
    Nak,
    Outcome,
    Processed,
    Term,
    Unavailable,
    decide,
)
from lanes_runtime.failures import classify

SPEC = ConsumerSpec(
    durable="t", stream=JOBS, subjects=("lanes.job.*.submitted",), max_deliver=4, redelivery_delays_s=(0.5, 2.0, 9.0)
)

TABLE: list[tuple[Outcome, int, Decision]] = [
    (Processed(), 1, Ack()),
    (Processed(), 4, Ack()),
    (Duplicate(), 1, Ack()),
    (Duplicate(), 7, Ack()),
    (Invalid("not JSON"), 1, Term("not JSON")),
    (Invalid("not JSON"), 3, Term("not JSON")),
    (Failed("boom"), 1, Nak(0.5)),
    (Failed("boom"), 2, Nak(2.0)),
    (Failed("boom"), 3, Nak(9.0)),
    (Failed("boom"), 4, Term("gave up after 4 deliveries; last error: boom")),
    (Failed("boom"), 9, Term("gave up after 9 deliveries; last error: boom")),
    (Failed("conflict", delay_s=0.05), 1, Nak(0.05)),
    (Failed("conflict", delay_s=0.05), 4, Term("gave up after 4 deliveries; last error: conflict")),
    # An outage never spends a delivery and never dead-letters, whatever the delivery count.
    (Unavailable("db down", outages=1), 1, Hold(OUTAGE_BACKOFF_S[0])),
    (Unavailable("db down", outages=2), 4, Hold(OUTAGE_BACKOFF_S[1])),
    (Unavailable("db down", outages=1000), 99, Hold(OUTAGE_BACKOFF_S[-1])),
]


@pytest.mark.parametrize(("outcome", "deliveries", "expected"), TABLE)
def test_decide(outcome: Outcome, deliveries: int, expected: Decision) -> None:
    assert decide(outcome, deliveries, SPEC) == expected


def test_a_long_outage_holds_for_ever_and_never_terminates() -> None:
    verdicts = {type(decide(Unavailable("down", outages=n), d, SPEC)) for n in range(1, 200) for d in range(1, 20)}
    assert verdicts == {Hold}


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (asyncpg.exceptions.AdminShutdownError("terminating connection"), Unavailable),
        (asyncpg.exceptions.CannotConnectNowError("starting up"), Unavailable),
        (asyncpg.exceptions.ConnectionDoesNotExistError("closed"), Unavailable),
        (asyncpg.exceptions.TooManyConnectionsError("too many"), Unavailable),
        (asyncpg.exceptions.DeadlockDetectedError("deadlock"), Unavailable),
        (ConnectionRefusedError(111, "refused"), Unavailable),
        (TimeoutError(), Unavailable),
        (ConnectionClosedError(), Unavailable),
        (ServiceUnavailableError(), Unavailable),
        (RedisConnectionError("gone"), Unavailable),
        (ServerUnavailableError("no NATS"), Unavailable),
        (PoisonEventError("never applies"), Invalid),
        (TransientError("try again"), Failed),
        (APIError(), Failed),  # an answer about the request, not an outage
        (asyncpg.exceptions.UniqueViolationError("dup"), Failed),
        (RuntimeError("a bug"), Failed),
        (KeyError("a bug"), Failed),
    ],
)
def test_classify_tells_an_outage_from_a_bad_event(error: Exception, kind: type) -> None:
    assert isinstance(classify(error), kind)


@pytest.mark.parametrize(("in_flight", "ordered"), [(0, False), (2, True)])
def test_a_consumer_takes_at_least_one_batch_and_an_ordered_one_exactly_one(in_flight: int, ordered: bool) -> None:
    # An ordered consumer folds after its batches' acks raised the ack floor: a second batch would race it.
    with pytest.raises(ValueError, match="in_flight"):
        ConsumerSpec(durable="t", stream=JOBS, subjects=("lanes.job.*.x",), in_flight=in_flight, ordered=ordered)
