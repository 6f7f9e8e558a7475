"""The telemetry as the composition root sees it: its tables and its two consumers.

`telemetry` ingests evidence from LANES_TELEMETRY; `telemetry-placements` keeps telemetry's own copy of
where each rank runs, read from the job stream (services never read each other's tables).
"""

from __future__ import annotations

from lanes_contract.streams import JOBS, TELEMETRY
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.service import ServiceDefinition
from lanes_runtime.store import migrations_of
from lanes_telemetry.service_layer.handlers import handle_evidence, handle_job_event

EVENTS = ConsumerSpec(durable="telemetry", stream=TELEMETRY, subjects=("lanes.tel.>",))
PLACEMENTS = ConsumerSpec(
    durable="telemetry-placements",
    stream=JOBS,
    subjects=("lanes.job.*.placed", "lanes.job.*.resources_released"),
)

SERVICE = ServiceDefinition(
    name="telemetry",
    migrations=migrations_of("lanes_telemetry.adapters"),
    consumers=((EVENTS, handle_evidence), (PLACEMENTS, handle_job_event)),
)
