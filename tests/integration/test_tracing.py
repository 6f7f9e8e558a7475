"""One trace per story: the spans of every service follow the `traceparent` each event carries.

A job whose rank fails runs through the scheduler, the lifecycle, a node agent and recovery; with an
in-memory exporter, every span the consumers opened for the job's events (submitted, placed, rank events,
the failed state change and recovery's decision) belongs to the trace the submission started.
"""

from __future__ import annotations

import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.cli import local_stack
from support.waiting import eventually

from lanes_cli.timeline import job_timeline
from lanes_contract.client import LanesClient
from lanes_contract.events import JobStateChanged, JobSubmitted, JobSubmittedData
from lanes_contract.jobs import JobSpec, JobState
from lanes_runtime.settings import ServerUrls
from lanes_runtime.tracing import current_traceparent

pytestmark = pytest.mark.real_servers

_EXPORTER = InMemorySpanExporter()


def _provider() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)  # once per process; later calls are ignored by the API


async def test_submit_placed_running_failed_and_recoverys_decision_are_one_trace(
    own_urls: ServerUrls, unique: str
) -> None:
    _provider()
    job_id = f"traced-{unique}"
    spec = JobSpec(
        name="traced", workers=1, command=(sys.executable, "-c", "print('lanes: communicator ready'); exit(3)")
    )
    async with local_stack(own_urls, ["scheduler", "lifecycle", "telemetry", "recovery"]) as conns:
        with trace.get_tracer("tests").start_as_current_span("lanes submit") as root:
            submitted = JobSubmitted(
                source="tests",
                jobid=job_id,
                attempt=1,
                traceparent=current_traceparent(),
                data=JobSubmittedData(spec=spec),
            )
            await LanesClient(conns.nc, "tests").publish(submitted)

        def spans() -> list[ReadableSpan]:
            return [s for s in _EXPORTER.get_finished_spans() if (s.attributes or {}).get("lanes.job") == job_id]

        def handled(event_name: str) -> bool:
            suffix = f".{event_name}.v1"
            return any(str((s.attributes or {}).get("lanes.event.type", "")).endswith(suffix) for s in spans())

        async def failed() -> JobStateChanged | None:
            found = [e.event for e in await job_timeline(conns.nc.jetstream(), job_id)]
            return next(
                (e for e in found if isinstance(e, JobStateChanged) and e.data.to_state is JobState.FAILED), None
            )

        async def recovery_saw_the_failure() -> bool:
            failure = await failed()
            return failure is not None and any(
                (s.attributes or {}).get("lanes.event.id") == failure.id
                and (s.attributes or {}).get("lanes.consumer") == "recovery"
                for s in spans()
            )

        await eventually(recovery_saw_the_failure, timeout_s=60, what="recovery's decision on the failure")
        failure = await failed()
    assert failure is not None
    assert failure.traceparent is not None
    assert failure.traceparent.split("-")[1] == f"{root.get_span_context().trace_id:032x}"  # carried on the log
    for name in ("submitted", "placed", "rank_started", "rank_exited", "state_changed"):
        assert handled(name), name
    trace_ids = {s.context.trace_id for s in spans() if s.context is not None}
    assert trace_ids == {root.get_span_context().trace_id}
