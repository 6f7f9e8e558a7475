"""The lifecycle as the composition root sees it: migrations and consumers."""

from __future__ import annotations

from lanes_common.consumer import ConsumerSpec
from lanes_common.service import ServiceDefinition
from lanes_common.store import migrations_of
from lanes_common.streams import JOBS
from lanes_lifecycle.service_layer.handlers import handle_job_event

JOB_EVENTS = ConsumerSpec(
    durable="lifecycle-jobs",
    stream=JOBS,
    subjects=tuple(
        f"lanes.job.*.{name}"
        for name in ("submitted", "waiting", "placed", "rank_started", "rank_exited", "resources_released")
    ),
)

SERVICE = ServiceDefinition(
    name="lifecycle",
    migrations=migrations_of("lanes_lifecycle.adapters"),
    consumers=((JOB_EVENTS, handle_job_event),),
)
