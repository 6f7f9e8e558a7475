"""`Readiness`: ready from the start until a failure, its gauge always the same, an outage logged once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge
from support.logs import JsonLogs, json_logs
from support.waiting import eventually

from lanes_contract.streams import JOBS
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.delivery import hold_through_outages
from lanes_runtime.health import Readiness

SPEC = ConsumerSpec(durable="unit-readiness", stream=JOBS, subjects=JOBS.subjects, redelivery_delays_s=(0.01,))


@pytest.fixture
def gauge() -> Gauge:
    return Gauge("ready", "1 when ready", registry=CollectorRegistry())


@pytest.fixture
def logs(capsys: pytest.CaptureFixture[str]) -> Iterator[JsonLogs]:
    with json_logs(capsys) as captured:
        yield captured


def _shows(readiness: Readiness, gauge: Gauge) -> bool:
    """What `ready` says, after checking that the gauge says the same."""
    (metric,) = gauge.collect()
    assert [sample.value for sample in metric.samples] == [1.0 if readiness.ready else 0.0]
    return readiness.ready


def test_ready_from_the_start_and_the_gauge_says_so(gauge: Gauge) -> None:
    assert _shows(Readiness("unit", gauge), gauge)


def test_not_ready_until_the_last_waiting_cause_answers(gauge: Gauge, logs: JsonLogs) -> None:
    readiness = Readiness("unit-two-causes", gauge)
    readiness.unavailable("batch", "ConnectionRefusedError: database down")
    readiness.unavailable("probe", "PostgreSQL did not answer SELECT 1 within 2.5 s")
    readiness.unavailable("batch", "ConnectionRefusedError: database down")
    readiness.answered("batch")
    assert not _shows(readiness, gauge)
    readiness.answered("probe")
    assert _shows(readiness, gauge)
    readiness.answered("probe")  # a cause that was not waiting changes nothing
    assert _shows(readiness, gauge)
    logs.assert_one_outage("unit-two-causes")
    assert logs.about("unit-two-causes")[-1]["retries"] == 3


def test_a_failed_loop_is_not_ready_for_good(gauge: Gauge) -> None:
    readiness = Readiness("unit-failed", gauge)
    readiness.unavailable("batch", "OSError: bus away")
    readiness.failed("NotFoundError: stream not found")
    readiness.answered("batch")
    assert not _shows(readiness, gauge)


async def test_batches_held_side_by_side_make_one_outage_that_ends_with_the_last(gauge: Gauge, logs: JsonLogs) -> None:
    readiness = Readiness(SPEC.durable, gauge)
    first_may_go, second_may_go = asyncio.Event(), asyncio.Event()

    def attempt(may_go: asyncio.Event) -> Callable[[], Awaitable[str]]:
        async def once() -> str:
            if not may_go.is_set():
                raise ConnectionRefusedError("database down")
            return "committed"

        return once

    first = asyncio.ensure_future(hold_through_outages(attempt(first_may_go), SPEC, readiness=readiness))
    second = asyncio.ensure_future(hold_through_outages(attempt(second_may_go), SPEC, readiness=readiness))

    async def both_held() -> bool:
        return not _shows(readiness, gauge) and logs.about(SPEC.durable) != []

    await eventually(both_held, what="both batches held")
    first_may_go.set()
    assert await first == "committed"
    assert not _shows(readiness, gauge)  # the second batch still waits
    second_may_go.set()
    assert await second == "committed"
    assert _shows(readiness, gauge)
    logs.assert_one_outage(SPEC.durable)
