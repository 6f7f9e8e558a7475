"""The lifecycle as the composition root sees it: migrations, the job-event consumer and the job API."""

from __future__ import annotations

from lanes_contract.streams import JOBS
from lanes_lifecycle.entrypoints.job_api import JobApi
from lanes_lifecycle.service_layer.handlers import handle_job_event
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.service import ServiceDefinition
from lanes_runtime.store import migrations_of

LIFECYCLE_INPUTS = (
    "submitted",
    "waiting",
    "rejected",
    "placed",
    "rank_started",
    "rendezvous_done",
    "communicator_ready",
    "heartbeat",
    "checkpoint_started",
    "checkpoint_saved",
    "artifact_produced",
    "rank_exited",
    "cancel_requested",
    "retry_requested",
    "hold_requested",
    "resume_requested",
    "resources_released",
    "finding",
)
"""The subject names (`lanes.job.*.<name>`) the lifecycle folds; a rebuild replays exactly these."""

JOB_EVENTS = ConsumerSpec(
    durable="lifecycle-jobs",
    stream=JOBS,
    subjects=tuple(f"lanes.job.*.{name}" for name in LIFECYCLE_INPUTS),
    # The fold depends on order (a rank cannot exit before its placement): one message in flight at a
    # time, so a crashed replica's message is redelivered before anything after it.
    batch=1,
    max_ack_pending=1,
)

SERVICE = ServiceDefinition(
    name="lifecycle",
    migrations=migrations_of("lanes_lifecycle.adapters"),
    consumers=((JOB_EVENTS, handle_job_event),),
    # The process that owns the projection also answers `lanes.api.job.*` (submit, cancel, retry, get).
    runners=(lambda context: JobApi(context.nc, context.pool),),
)
