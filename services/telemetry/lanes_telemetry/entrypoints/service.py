"""The telemetry as the composition root sees it: its tables, its three consumers and its settle timer.

`telemetry` ingests evidence from LANES_TELEMETRY; `telemetry-placements` keeps telemetry's own copy of
where each rank runs and how it ended, read from the job stream (services never read each other's tables),
and settles findings; `telemetry-progress` reads the heartbeats' step timings for slow ranks and degraded
links; the settle timer closes the settle window of failed attempts.
"""

from __future__ import annotations

import os
from datetime import timedelta

from lanes_contract.streams import JOBS, TELEMETRY
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.service import RunnerContext, ServiceDefinition
from lanes_runtime.store import migrations_of
from lanes_telemetry.domain.election import DEFAULT_CAUSE_WINDOW
from lanes_telemetry.domain.settlement import DEFAULT_SETTLE_WINDOW
from lanes_telemetry.entrypoints.timers import SettleTimers
from lanes_telemetry.service_layer.handlers import Telemetry
from lanes_telemetry.service_layer.progress import SlowRanks

JOB_FACTS = ("placed", "resources_released", "rank_started", "rank_exited", "state_changed", "settle_window_ended")
"""The subject names (`lanes.job.*.<name>`) telemetry folds."""
# Evidence comes in storms (thousands of lines per failure): batches of 256 share one transaction, and two are
# processed at once (one's statements wait on PostgreSQL while the other's handlers run; evidence takes its
# nodes' locks shared, so the two do not wait for each other). The ingest bench runs this spec.
#
# Every consumer has a pinned client (a NATS priority group, ADR-42): the server delivers each durable to one
# replica at a time, so a job's evidence and facts are correlated and its first error elected in one process,
# never split between two that would each elect from half. A replica that stops pulling (killed, paused) loses
# the pin after PIN_TIMEOUT_S, and a stand-by replica, pulling meanwhile, takes it over where it stood.
PIN_TIMEOUT_S = 5.0
EVENTS = ConsumerSpec(
    durable="telemetry", stream=TELEMETRY, subjects=("lanes.tel.>",), batch=256, in_flight=2, pinned_s=PIN_TIMEOUT_S
)
PLACEMENTS = ConsumerSpec(
    durable="telemetry-placements",
    stream=JOBS,
    subjects=tuple(f"lanes.job.*.{name}" for name in JOB_FACTS),
    pinned_s=PIN_TIMEOUT_S,
)
PROGRESS = ConsumerSpec(
    durable="telemetry-progress",
    stream=JOBS,
    subjects=("lanes.job.*.heartbeat",),
    batch=256,
    pinned_s=PIN_TIMEOUT_S,
)
"""Heartbeats, for the step timings they carry (slow ranks, degraded links); apart from the facts above, so a
busy job's heartbeats never delay the placements that correlate evidence."""
SETTLE_WINDOW_ENV = "LANES_SETTLE_WINDOW_S"
CAUSE_WINDOW_ENV = "LANES_CAUSE_WINDOW_S"


def configured_window() -> timedelta:
    """The settle window: LANES_SETTLE_WINDOW_S, else the default."""
    value = os.environ.get(SETTLE_WINDOW_ENV)
    return DEFAULT_SETTLE_WINDOW if not value else timedelta(seconds=float(value))


def configured_cause_window() -> timedelta:
    """The cause window: LANES_CAUSE_WINDOW_S (seconds before an attempt's first exit), else 300 s."""
    value = os.environ.get(CAUSE_WINDOW_ENV)
    return DEFAULT_CAUSE_WINDOW if not value else timedelta(seconds=float(value))


def telemetry_service(
    settle_window: timedelta | None = None,
    *,
    cause_window: timedelta | None = None,
    events: ConsumerSpec = EVENTS,
    facts: ConsumerSpec = PLACEMENTS,
    tick_s: float = 0.25,
) -> ServiceDefinition:
    """The telemetry service with its settle and cause windows.

    Defaults: LANES_SETTLE_WINDOW_S, else 5 s; LANES_CAUSE_WINDOW_S, else 300 s.
    """
    telemetry = Telemetry(settle_window or configured_window(), cause_window=cause_window or configured_cause_window())

    def timers(ctx: RunnerContext) -> SettleTimers:
        return SettleTimers(ctx.nc, ctx.pool, tick_s=tick_s)

    return ServiceDefinition(
        name="telemetry",
        migrations=migrations_of("lanes_telemetry.adapters"),
        consumers=(
            (events, telemetry.handle_evidence),
            (facts, telemetry.handle_job_event),
            (PROGRESS, SlowRanks().handle_progress),
        ),
        runners=(timers,),
    )


SERVICE = telemetry_service()
